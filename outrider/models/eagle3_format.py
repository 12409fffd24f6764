"""EAGLE-3 drafter configs in the engines' conventions: the layouts, the aux layer ids (SGLang's
explicit ids are one below vLLM's and ours), and config.json both ways, the `speculators`
library's nested config included. Tensors and files: models/eagle3_io.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from outrider.loaders.hf_config import ModelConfig
from outrider.models.eagle3 import Eagle3Config

log = logging.getLogger(__name__)
LAYOUTS = ("sglang", "vllm", "speculators")
ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's EntryClass; vLLM registers it as an alias
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
LAYER_PREFIX = {"sglang": "midlayer.", "vllm": "layers.0.", "speculators": "layers.0."}
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
# Whose aux-id convention each layout's ids are in. vLLM loads speculators files natively: it
# lifts transformer_layer_config to the top level, copies the EAGLE-3 fields beside it and
# passes the ids and the tensor names through unchanged (vLLM's speculators config, algos.py
# update_eagle3), so a speculators file reads as a vLLM one.
CONVENTION = {"sglang": "sglang", "vllm": "vllm", "speculators": "vllm"}
_SPECULATORS_KEYS = frozenset(("speculators_model_type", "speculators_config",
                               "transformer_layer_config"))  # fmt: skip


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
    if CONVENTION[layout] == "sglang":
        return [int(i) - 1 for i in aux_layers]
    return [int(i) for i in aux_layers]


def outrider_aux_layers(ids: Sequence[int], layout: str) -> tuple[int, ...]:
    """The inverse of `engine_aux_ids`: explicit ids as `layout`'s engine reads them -> ours."""
    check_layout(layout)
    if CONVENTION[layout] == "sglang":
        return tuple(int(i) + 1 for i in ids)
    return tuple(int(i) for i in ids)


def explicit_aux_ids(config: dict[str, Any], layout: str) -> list[int] | None:
    """The ids `layout`'s engine would read from this config.json, None when it names none
    (the engine then uses its default). SGLang reads eagle_config only; vLLM reads the top-level
    key first and (newer versions) falls back to eagle_config; a speculators file, flattened by
    read_config, has them top-level."""
    check_layout(layout)
    nested = (config.get("eagle_config") or {}).get(AUX_KEY)
    ids = nested if CONVENTION[layout] == "sglang" else config.get(AUX_KEY) or nested
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{AUX_KEY}={ids!r} in config.json must be a list of integers")
    return ids


def aux_layers_from_config(
    config: dict[str, Any], layout: str, target: ModelConfig
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
        other = "sglang" if CONVENTION[layout] == "vllm" else "vllm"
        hint = f", or the file uses the other engine's convention (try layout={other!r})"
        if "speculators_config" in config:  # its ids are vLLM's, whatever the caller says
            hint = ""
        raise ValueError(
            f"aux layers {list(aux)} (read as {layout} ids {ids}) must be distinct layer indices "
            f"in 0..{n - 1} of the {n}-layer target: the drafter was made for a deeper model{hint}"
        )
    return aux


# ---- config.json -----------------------------------------------------------------------


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json as the flat EAGLE-3 config the loaders read; a speculators file is
    flattened the way vLLM flattens it (see `from_speculators`)."""
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
    if not isinstance(config, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(config).__name__}, not a config object")
    if _SPECULATORS_KEYS & config.keys():
        return from_speculators(config, file)
    return config


def resolve_layout(config: dict[str, Any], layout: str | None = None) -> str:
    """The convention, "sglang" or "vllm", that this config's aux ids are read in (CONVENTION).
    A speculators file is vLLM's; then the file's own record (outrider.layout) wins; then the
    caller's `layout`; then a file whose only ids are top-level is vLLM's (SGLang never reads
    that key); else "sglang", what SpecForge writes."""
    if layout is not None:
        check_layout(layout)
    own = "speculators" if "speculators_config" in config else None
    own = own or (config.get("outrider") or {}).get("layout")
    if own is not None:
        check_layout(own)
        if layout is not None and CONVENTION[layout] != CONVENTION[own]:
            log.warning("drafter config.json is in the %s layout; ignoring layout=%r", own, layout)
        return CONVENTION[own]
    if layout is not None:
        return CONVENTION[layout]
    nested = (config.get("eagle_config") or {}).get(AUX_KEY)
    return "vllm" if config.get(AUX_KEY) and not nested else "sglang"


def config_from_json(config: dict[str, Any], target: ModelConfig, layout: str) -> Eagle3Config:
    """An Eagle3Config from config.json, checked against the target it will serve."""
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    if missing := [k for k in required if k not in config]:
        raise ValueError(f"drafter config.json lacks {missing}: it is not an EAGLE-3 config")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"drafter num_hidden_layers={config['num_hidden_layers']}: outrider runs the "
            f"one-layer EAGLE-3 drafter only"
        )
    norm_before_residual = config.get("norm_before_residual", False)
    if not isinstance(norm_before_residual, bool):
        raise ValueError(
            f"drafter norm_before_residual={norm_before_residual!r}: set true or false as the "
            "drafter was trained"
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
        norm_before_residual=norm_before_residual,
    )


def config_json(cfg: Eagle3Config, layout: str, extra: dict[str, Any], dtype: torch.dtype):
    check_layout(layout)
    if cfg.norm_before_residual and layout == "sglang":
        raise ValueError(
            "this drafter's residual is the normed hidden (norm_before_residual), which "
            "SGLang's EAGLE-3 layer does not compute: export it as vllm or speculators"
        )
    ids = engine_aux_ids(cfg.aux_layers, layout)
    own = {"format_version": 1, "layout": layout, "aux_layers": list(cfg.aux_layers), **extra}
    dtype_name = str(dtype).removeprefix("torch.")
    if layout == "speculators":
        return to_speculators(cfg, ids, own, dtype_name)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": "llama", **_llama_layer(cfg),
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        # SGLang ties lm_head to the embedding when true: wrong for a draft-vocab head.
        "tie_word_embeddings": False, "torch_dtype": dtype_name,
        "eagle_config": {AUX_KEY: ids, "use_aux_hidden_state": True},
    }  # fmt: skip
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if layout == "vllm":
        # vLLM reads the top-level key (older versions nothing else). Never written for SGLang
        # files: a vLLM reading SGLang-convention ids there would capture one layer early.
        out[AUX_KEY] = ids
        out["norm_before_residual"] = cfg.norm_before_residual
    out["outrider"] = own
    return out


def _llama_layer(cfg: Eagle3Config) -> dict[str, Any]:
    """The drafter's decoder layer as HF Llama config fields (vocab_size is the target's)."""
    return {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
    }  # fmt: skip


# ---- the speculators layout ------------------------------------------------------------
#
# github.com/vllm-project/speculators, Eagle3SpeculatorConfig (models/eagle3/config.py) and
# SpeculatorsConfig (config.py); vLLM reads it in transformers_utils/configs/speculators/.
#
#   speculators_model_type "eagle3", architectures ["Eagle3DraftModel"] (older: Eagle3Speculator)
#   transformer_layer_config   the decoder layer, an HF Llama config; its vocab_size is the target's
#   draft_vocab_size, target_hidden_size (null: hidden_size), eagle_aux_hidden_state_layer_ids
#       (null: the default layers; ids in vLLM's convention), norm_before_residual (computed),
#       norm_before_fc, fc_norm, norm_output (variants outrider's layer does not compute)
#   speculators_config {algorithm "eagle3", proposal_methods [{proposal_type "greedy",
#       speculative_tokens, ...}], default_proposal_method, verifier {name_or_path, architectures}}

SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"  # the class speculators saves EAGLE-3 drafters from
# The draft length vLLM defaults to for this drafter (its num_speculative_tokens); speculators'
# converter writes 3 too. outrider's own controller ignores it.
SPECULATIVE_TOKENS = 3
_VARIANTS = {  # EAGLE-3 variants speculators can train that outrider's layer does not compute
    "norm_before_fc": "an RMSNorm over the concatenated aux states before fc",
    "fc_norm": "an RMSNorm per aux state before fc",
    "norm_output": "the normed hidden is fed back between steps (EAGLE 3.1)",
}
_LAYER, _SPEC = "transformer_layer_config.", "speculators_config."
_UNLIKE = "outrider's drafter layer is the plain Llama one; use another drafter"


def _positive_int(v: Any) -> bool:
    return type(v) is int and v > 0


def _methods_ok(v: Any) -> bool:
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(m, dict) and isinstance(m.get("proposal_type"), str) for m in v)
    )


# (field, acceptable?, what to do), checked in order: a field's parent is an object by the
# time the field is read. What speculators' config models and vLLM's loader require, and
# what outrider's drafter layer computes.
# fmt: off
_SPECULATORS_RULES: tuple[tuple[str, Any, str], ...] = (
    ("speculators_model_type", lambda v: v == "eagle3",
     'outrider serves EAGLE-3 speculators only ("eagle3")'),
    ("transformer_layer_config", lambda v: isinstance(v, dict),
     "it must be the drafter layer's Llama config, an object; re-save the drafter"),
    (_LAYER + "model_type", lambda v: v in (None, "llama"),
     "outrider's drafter layer is Llama's (Qwen3's adds q/k norms); use a llama-layer drafter"),
    *((_LAYER + k, _positive_int, "a positive integer is required; the config is incomplete")
      for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")),
    (_LAYER + "num_hidden_layers", lambda v: v in (None, 1),
     "outrider runs the one-layer EAGLE-3 drafter only"),
    (_LAYER + "hidden_act", lambda v: v in (None, "silu"), _UNLIKE),
    *((_LAYER + k, lambda v: not v, _UNLIKE)
      for k in ("attention_bias", "mlp_bias", "use_sliding_window")),
    (_LAYER + "layer_types", lambda v: "sliding_attention" not in (v or ()), _UNLIKE),
    ("draft_vocab_size", _positive_int, "set it to lm_head's row count (speculators reads a "
     "missing one as 32000, vLLM as the target's vocabulary)"),
    ("norm_before_residual", lambda v: isinstance(v, bool), "set true or false as the drafter "
     "was trained (speculators reads a missing one as false, vLLM as true)"),
    *((k, lambda v: not v, f"{what}: outrider's drafter layer does not compute that; use a "
       "drafter trained without it") for k, what in _VARIANTS.items()),
    ("target_hidden_size", lambda v: v is None or _positive_int(v),
     "use the target's hidden size, or null for the drafter's own"),
    ("speculators_config", lambda v: isinstance(v, dict), "it must be an object with "
     "algorithm, proposal_methods, default_proposal_method and verifier"),
    (_SPEC + "algorithm", lambda v: v == "eagle3", 'an EAGLE-3 speculator says "eagle3"'),
    (_SPEC + "proposal_methods", _methods_ok,
     'list at least one {"proposal_type": "greedy", "speculative_tokens": N}'),
    (_SPEC + "verifier", lambda v: isinstance(v, dict) and "name_or_path" in v,
     'use {"name_or_path": <the target\'s id or path, or null>, "architectures": [...]}'),
    (_SPEC + "verifier.name_or_path", lambda v: v is None or isinstance(v, str),
     "use the target's Hugging Face id or path, or null"),
    (_SPEC + "verifier.architectures", lambda v: isinstance(v, list),
     'list the target\'s architectures, e.g. ["LlamaForCausalLM"], or []'),
)
# fmt: on


def to_speculators(cfg: Eagle3Config, ids: list[int], own: dict[str, Any], dtype: str):
    """config.json in the speculators layout. Every EAGLE-3 field is written, defaults too:
    vLLM reads a missing norm_before_residual as true, speculators as false."""
    layer = {"model_type": "llama", **_llama_layer(cfg), "mlp_bias": False}
    layer.update(tie_word_embeddings=False, torch_dtype=dtype)
    if cfg.rope_scaling:
        layer["rope_scaling"] = dict(cfg.rope_scaling)
    target = own.get("target")  # the trainer's fingerprint of the target, when there is one
    target = target if isinstance(target, dict) else {}
    name, arch = target.get("model"), target.get("architecture")
    greedy = {"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS,
              "verifier_accept_k": 1, "accept_tolerance": 0.0}  # fmt: skip
    return {
        "architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size, **dict.fromkeys(_VARIANTS, False),
        "norm_before_residual": cfg.norm_before_residual,
        AUX_KEY: ids,
        "speculators_config": {
            "algorithm": "eagle3", "proposal_methods": [greedy],
            "default_proposal_method": "greedy",
            # null: `vllm serve <drafter>` cannot find the target; serve the target with
            # --speculative-config '{"model": <drafter>}' instead.
            "verifier": {"name_or_path": name if isinstance(name, str) else None,
                         "architectures": [arch] if isinstance(arch, str) else []},
        },
        "torch_dtype": dtype, "outrider": own,
    }  # fmt: skip


def from_speculators(config: dict[str, Any], file: str | Path) -> dict[str, Any]:
    """A speculators EAGLE-3 config.json -> the flat config the loaders read, built as vLLM
    builds it: transformer_layer_config's fields with the EAGLE-3 fields beside them (its
    speculators_config stays: it marks the layout). Refuses, naming the field, what is
    malformed and what outrider's drafter layer would compute differently."""

    def need(ok: bool, field: str, value: Any, fix: str) -> None:
        if not ok:
            shown = "missing" if value is None else repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValueError(f"{str(file)!r} (speculators layout): {field} is {shown}: {fix}")

    def at(field: str) -> Any:
        value = config
        for key in field.split("."):  # every parent passed its own rule: an object
            value = value.get(key)
        return value

    for field, ok, fix in _SPECULATORS_RULES:
        need(ok(at(field)), field, at(field), fix)
    spec = config["speculators_config"]
    types = [m["proposal_type"] for m in spec["proposal_methods"]]
    default = spec.get("default_proposal_method")
    need(default in types, _SPEC + "default_proposal_method", default,
         f"name one of the proposal_methods' types {types}")  # fmt: skip
    i = types.index(default)
    tokens = spec["proposal_methods"][i].get("speculative_tokens")
    need(_positive_int(tokens), f"{_SPEC}proposal_methods[{i}].speculative_tokens", tokens,
         "vLLM takes its default draft length from it: set a positive integer")  # fmt: skip
    flat = {**config["transformer_layer_config"]}
    flat["norm_before_residual"] = config["norm_before_residual"]
    flat["draft_vocab_size"] = config["draft_vocab_size"]
    for key in ("target_hidden_size", AUX_KEY):  # null: the defaults (ids checked when read)
        if config.get(key) is not None:
            flat[key] = config[key]
    flat["speculators_config"] = spec
    if "outrider" in config:
        flat["outrider"] = config["outrider"]
    return flat


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown: pick one of {list(LAYOUTS)}")
