"""EAGLE-3 drafter configs in the engines' conventions: the layouts, the aux layer ids (SGLang's
explicit ids are one below vLLM's and ours), and config.json both ways. Tensors and files:
models/eagle3_io.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from outrider.loaders.hf_config import TransformerConfig
from outrider.models.eagle3 import Eagle3Config

log = logging.getLogger(__name__)
LAYOUTS = ("sglang", "vllm")
ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's EntryClass; vLLM registers it as an alias
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
LAYER_PREFIX = {"sglang": "midlayer.", "vllm": "layers.0."}
AUX_KEY = "eagle_aux_hidden_state_layer_ids"


# ---- aux layer ids ---------------------------------------------------------------------


def engine_aux_ids(aux_layers: Sequence[int], layout: str) -> list[int]:
    """outrider's aux layers (i = the residual stream *entering* layer i is captured, HF
    hidden_states[i]) -> the explicit ids `layout`'s engine reads from config.json.

    SGLang: set_eagle3_layers_to_capture stores `[val + 1 for val in layer_ids]` and its model
    captures `hidden_states + residual` before running each layer in that list, so an explicit
    id k captures the input of layer k + 1 (= the output of layer k): write i - 1.
    vLLM: the target captures before layer idx for `idx in aux_hidden_state_layers` with the ids
    used as given, so id k captures the input of layer k, our convention: write i.
    Without explicit ids both engines capture inputs of (2, L//2, L-3), our default.
    Worked example, L = 30: ours (2, 15, 27) -> SGLang [1, 14, 26], vLLM [2, 15, 27].
    """
    check_layout(layout)
    return [int(i) - 1 for i in aux_layers] if layout == "sglang" else [int(i) for i in aux_layers]


def outrider_aux_layers(ids: Sequence[int], layout: str) -> tuple[int, ...]:
    """The inverse of `engine_aux_ids`: explicit ids as `layout`'s engine reads them -> ours."""
    check_layout(layout)
    return tuple(int(i) + 1 for i in ids) if layout == "sglang" else tuple(int(i) for i in ids)


def explicit_aux_ids(config: dict[str, Any], layout: str) -> list[int] | None:
    """The ids `layout`'s engine would read from this config.json, None when it names none
    (the engine then uses its default). SGLang reads eagle_config only; vLLM reads the top-level
    key first and (newer versions) falls back to eagle_config."""
    check_layout(layout)
    nested = (config.get("eagle_config") or {}).get(AUX_KEY)
    ids = nested if layout == "sglang" else config.get(AUX_KEY) or nested
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{AUX_KEY}={ids!r} in config.json must be a list of integers")
    return ids


def aux_layers_from_config(
    config: dict[str, Any], layout: str, target: TransformerConfig
) -> tuple[int, ...]:
    """The drafter's aux layers in outrider's convention, checked against the target."""
    ids = explicit_aux_ids(config, layout)
    aux = target.aux_hidden_layers if ids is None else outrider_aux_layers(ids, layout)
    recorded = (config.get("outrider") or {}).get("aux_layers")
    if ids is not None and recorded is not None and tuple(recorded) != aux:
        raise ValueError(
            f"config.json is inconsistent: {layout} ids {ids} mean aux layers {list(aux)}, but "
            f"its outrider.aux_layers says {recorded}; someone edited one of them: fix the other "
            f"to match, or re-export the drafter"
        )
    n = target.num_hidden_layers
    bad = [i for i in aux if not 0 <= i < n]
    if bad or len(set(aux)) != len(aux):
        raise ValueError(
            f"aux layers {list(aux)} (read as {layout} ids {ids}) must be distinct layer indices "
            f"in 0..{n - 1} of the {n}-layer target: the drafter was made for a deeper model, or "
            f"the file uses the other engine's convention (try layout="
            f"{'vllm' if layout == 'sglang' else 'sglang'!r})"
        )
    return aux


# ---- config.json -----------------------------------------------------------------------


def read_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(file)!r} not found: pass an EAGLE-3 drafter directory (config.json + "
            f"model.safetensors)"
        )
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{str(file)!r} is not valid JSON ({e}): re-download or re-export it"
        ) from e
    if "transformer_layer_config" in config or "speculators_config" in config:
        raise ValueError(
            f"{str(file)!r} is in the `speculators` format (Eagle3Speculator): outrider reads the "
            f"SGLang/vLLM LlamaForCausalLMEagle3 layout; use the original SpecForge/SGLang export"
        )
    return config


def resolve_layout(config: dict[str, Any], layout: str | None = None) -> str:
    """The file's own record (outrider.layout) wins; then the caller's `layout`; then a file
    whose only ids are top-level is vLLM's (SGLang never reads that key); else "sglang",
    what SpecForge writes."""
    own = (config.get("outrider") or {}).get("layout")
    if own is not None:
        check_layout(own)
        if layout is not None and layout != own:
            log.warning("drafter config.json records layout %r; ignoring layout=%r", own, layout)
        return own
    if layout is not None:
        check_layout(layout)
        return layout
    nested = (config.get("eagle_config") or {}).get(AUX_KEY)
    return "vllm" if config.get(AUX_KEY) and not nested else "sglang"


def config_from_json(
    config: dict[str, Any], target: TransformerConfig, layout: str
) -> Eagle3Config:
    """An Eagle3Config from config.json, checked against the target it will serve."""
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    if missing := [k for k in required if k not in config]:
        raise ValueError(f"drafter config.json lacks {missing}: it is not an EAGLE-3 config")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"drafter num_hidden_layers={config['num_hidden_layers']}: outrider runs the "
            f"one-layer EAGLE-3 drafter only"
        )
    if config.get("norm_before_residual"):  # vLLM's variant: the residual is the normed hidden
        raise ValueError(
            "drafter config.json sets norm_before_residual=true: outrider's drafter adds the "
            "un-normed hidden as residual (SGLang's and SpecForge's layer); it would run wrongly"
        )
    hidden = config["hidden_size"]
    target_hidden = config.get("target_hidden_size") or hidden  # what SGLang and vLLM assume
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"drafter target_hidden_size={target_hidden} but the target's hidden_size is "
            f"{target.hidden_size}: the drafter was trained for another model; use a drafter "
            f"for this target or train one (outrider drafter train)"
        )
    if config["vocab_size"] != target.vocab_size:
        raise ValueError(
            f"drafter vocab_size={config['vocab_size']} but the target's vocabulary has "
            f"{target.vocab_size} tokens: the drafter was trained for another tokenizer; use a "
            f"drafter trained for this target"
        )
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    theta = config.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
    if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        vocab_size=config["vocab_size"],
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        target_hidden_size=target_hidden,
        aux_layers=aux_layers_from_config(config, layout, target),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta),
        rope_scaling=dict(rope) if rope else None,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
    )


def config_json(cfg: Eagle3Config, layout: str, extra: dict[str, Any], dtype: torch.dtype):
    ids = engine_aux_ids(cfg.aux_layers, layout)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # SGLang ties lm_head to the embedding when true: wrong for a draft-vocab head.
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {AUX_KEY: ids, "use_aux_hidden_state": True},
    }  # fmt: skip
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if layout == "vllm":
        # vLLM reads the top-level key (older versions nothing else). Never written for SGLang
        # files: a vLLM reading SGLang-convention ids there would capture one layer early.
        out[AUX_KEY] = ids
    out["outrider"] = {"format_version": 1, "layout": layout, "aux_layers": list(cfg.aux_layers)}
    out["outrider"].update(extra)
    return out


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown: pick one of {list(LAYOUTS)}")
