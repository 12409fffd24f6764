"""EAGLE-3 drafters on disk, in the layouts SGLang and vLLM load (SpecForge writes SGLang's).

A drafter directory holds `config.json` (an HF Llama config, architectures
["LlamaForCausalLMEagle3"], plus vocab_size / draft_vocab_size / target_hidden_size and the aux
layer ids) and `model.safetensors` with unpacked HF tensor names:

    fc.weight                                   [H, 3 * Ht]
    <layer>.{input_layernorm,hidden_norm,post_attention_layernorm}.weight      [H]
    <layer>.self_attn.{q,k,v}_proj.weight       [heads * hd | kv * hd, 2H]
    <layer>.self_attn.o_proj.weight             [H, heads * hd]
    <layer>.mlp.{gate,up}_proj.weight [I, H]    <layer>.mlp.down_proj.weight [H, I]
    norm.weight [H]    lm_head.weight [draft_vocab, H]    d2t int64 [draft_vocab]    t2d bool [vocab]

<layer> is `midlayer` for SGLang (its LlamaForCausalLMEagle3 has a `midlayer` module and drops
names it does not know without a word, so `layers.0.*` would load as random weights) and
`layers.0` for vLLM (its Eagle3 LlamaModel keeps the layer in `layers`; its loader also renames
`midlayer.` to `layers.0.`). Loading accepts both, with or without a `model.` prefix. The
target's embedding is shared, never stored; a shipped `embed_tokens.weight` is ignored.

Aux layer ids: see `engine_aux_ids`. Invariant: save -> load returns bit-identical parameters,
d2t, t2d and aux_layers for either layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from outrider.loaders.hf_config import TransformerConfig
from outrider.models.eagle3 import Eagle3Config, Eagle3Draft
from outrider.models.weights import load_weights
from outrider.spec.eagle3_vocab import resolve_draft_vocab

log = logging.getLogger(__name__)

LAYOUTS = ("sglang", "vllm")
ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's EntryClass; vLLM registers it as an alias
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
_LAYER_PREFIX = {"sglang": "midlayer.", "vllm": "layers.0."}
_AUX_KEY = "eagle_aux_hidden_state_layer_ids"


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
    _check_layout(layout)
    return [int(i) - 1 for i in aux_layers] if layout == "sglang" else [int(i) for i in aux_layers]


def outrider_aux_layers(ids: Sequence[int], layout: str) -> tuple[int, ...]:
    """The inverse of `engine_aux_ids`: explicit ids as `layout`'s engine reads them -> ours."""
    _check_layout(layout)
    return tuple(int(i) + 1 for i in ids) if layout == "sglang" else tuple(int(i) for i in ids)


def explicit_aux_ids(config: dict[str, Any], layout: str) -> list[int] | None:
    """The ids `layout`'s engine would read from this config.json, None when it names none
    (the engine then uses its default). SGLang reads eagle_config only; vLLM reads the top-level
    key first and (newer versions) falls back to eagle_config."""
    _check_layout(layout)
    nested = (config.get("eagle_config") or {}).get(_AUX_KEY)
    ids = nested if layout == "sglang" else config.get(_AUX_KEY) or nested
    if not ids:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{_AUX_KEY}={ids!r} in config.json must be a list of integers")
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
        _check_layout(own)
        if layout is not None and layout != own:
            log.warning("drafter config.json records layout %r; ignoring layout=%r", own, layout)
        return own
    if layout is not None:
        _check_layout(layout)
        return layout
    nested = (config.get("eagle_config") or {}).get(_AUX_KEY)
    return "vllm" if config.get(_AUX_KEY) and not nested else "sglang"


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


def _config_json(cfg: Eagle3Config, layout: str, extra: dict[str, Any], dtype: torch.dtype):
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
        "eagle_config": {_AUX_KEY: ids, "use_aux_hidden_state": True},
    }  # fmt: skip
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if layout == "vllm":
        # vLLM reads the top-level key (older versions nothing else). Never written for SGLang
        # files: a vLLM reading SGLang-convention ids there would capture one layer early.
        out[_AUX_KEY] = ids
    out["outrider"] = {"format_version": 1, "layout": layout, "aux_layers": list(cfg.aux_layers)}
    out["outrider"].update(extra)
    return out


# ---- tensors ---------------------------------------------------------------------------


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Canonical (midlayer.*) tensor name -> shape, for a drafter with config `cfg`."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = {
        "input_layernorm.weight": (h,), "hidden_norm.weight": (h,),
        "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
        "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
    }  # fmt: skip
    return {
        "fc.weight": (h, len(cfg.aux_layers) * cfg.target_hidden_size),
        **{f"midlayer.{k}": v for k, v in layer.items()},
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


_SHAPE_SOURCE = {
    "fc.weight": "hidden_size, 3 * target_hidden_size",
    "lm_head.weight": "draft_vocab_size, hidden_size",
    "d2t": "draft_vocab_size",
    "t2d": "vocab_size",
}


def check_tensors(tensors: dict[str, torch.Tensor], cfg: Eagle3Config, where: Path) -> None:
    """Raise naming every missing or misshapen tensor (d2t/t2d may be absent: derived)."""
    expect = expected_shapes(cfg)
    wrong = [
        f"{name} is {tuple(t.shape)}, config.json's "
        f"{_SHAPE_SOURCE.get(name, 'hidden_size/heads/head_dim/intermediate_size')} give "
        f"{expect[name]}"
        for name, t in tensors.items()
        if name in expect and tuple(t.shape) != expect[name]
    ]
    if wrong:
        raise ValueError(
            f"{str(where)!r}: tensors do not match config.json: {'; '.join(wrong[:4])}: the "
            f"config was edited or belongs to another drafter"
        )
    if unknown := sorted(tensors.keys() - expect.keys()):  # load_weights would only warn
        raise ValueError(
            f"{str(where)!r} holds tensors the EAGLE-3 drafter has no place for: {unknown[:4]} "
            f"(biases? another drafter architecture); outrider would serve it without them"
        )
    missing = [n for n in expect if n not in tensors and n not in ("d2t", "t2d")]
    if missing:
        raise ValueError(
            f"{str(where)!r} lacks {len(missing)} drafter tensor(s): {missing[:5]}: the export is "
            f"incomplete or not an EAGLE-3 drafter"
        )


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the drafter directory on CPU, under canonical names (`midlayer.*`, no
    `model.` prefix). Raises ValueError naming a file that is not readable safetensors."""
    path = Path(path)
    files = [path / WEIGHTS_FILE] if (path / WEIGHTS_FILE).is_file() else []
    files = files or sorted(path.glob("model-*.safetensors"))  # unindexed shards
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin"))
        hint = (
            f"it has pickle weights ({', '.join(pickles[:2])}), which outrider does not load; "
            f"convert them with safetensors.torch.save_file"
            if pickles
            else "export the drafter again"
        )
        raise FileNotFoundError(f"{str(path)!r} has no {WEIGHTS_FILE}: {hint}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if not name.endswith("rotary_emb.inv_freq"):  # derived, some exports keep it
                        out[_canonical(name)] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"{str(file)!r} is not a readable safetensors file ({e}): it is truncated or "
                f"corrupt; download or export the drafter again"
            ) from e
    if (embed := out.pop("embed_tokens.weight", None)) is not None:
        log.info("ignoring the drafter's embed_tokens.weight %s: the target's is used", embed.shape)
    return out


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    if name.startswith(("layers.", "midlayers.", "additional_layers.")):
        raise ValueError(
            f"drafter tensor {name!r} belongs to a second decoder layer: outrider runs the "
            f"one-layer EAGLE-3 drafter only"
        )
    return name


# ---- save / load -----------------------------------------------------------------------


def save_drafter(
    draft: Eagle3Draft,
    path: str | Path,
    layout: str = "sglang",
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `draft` to directory `path` (config.json + model.safetensors) for `layout`'s
    engine. Atomic: written into a temporary directory beside `path`, then renamed; an existing
    drafter directory at `path` is replaced whole. `extra` (JSON) goes under config["outrider"]."""
    _check_layout(layout)
    extra = dict(extra or {})
    if clash := {"layout", "aux_layers", "format_version"} & extra.keys():
        raise ValueError(f"extra may not set {sorted(clash)}: save_drafter writes those itself")
    try:
        json.dumps(extra)
    except TypeError as e:
        raise ValueError(f"extra must be JSON-serializable: {e}") from e
    cfg = draft.config
    attn, mlp = draft.midlayer.self_attn, draft.midlayer.mlp
    if attn.qkv_proj.tp_size != 1 or mlp.gate_up_proj.tp_size != 1 or draft.fc.tp_size != 1:
        raise ValueError("save_drafter needs an unsharded drafter (tp_size 1): gather it first")
    sd = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = sd.pop("midlayer.self_attn.qkv_proj.weight")  # [q + 2 kv, 2H] -> three
    gate_up = sd.pop("midlayer.mlp.gate_up_proj.weight")  # [2I, H] -> two
    for name, part in zip(("q", "k", "v"), qkv.split([q, kv, kv]), strict=True):
        sd[f"midlayer.self_attn.{name}_proj.weight"] = part
    for name, part in zip(("gate", "up"), gate_up.split(cfg.intermediate_size), strict=True):
        sd[f"midlayer.mlp.{name}_proj.weight"] = part
    check_tensors(sd, cfg, Path(path))  # a parameter new to Eagle3Draft needs a name here first
    prefix = _LAYER_PREFIX[layout]
    # clone: split views share storage, which safetensors refuses.
    tensors = {
        (prefix + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v.clone()
        for k, v in sd.items()
    }
    config = _config_json(cfg, layout, extra, sd["fc.weight"].dtype)
    return _write_atomically(Path(path), config, tensors)


def load_drafter(
    path: str | Path,
    target: TransformerConfig,
    layout: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,  # None: the stored dtype
    max_positions: int | None = None,
) -> Eagle3Draft:
    """A drafter directory (ours, SpecForge's, SGLang's or vLLM's) -> an Eagle3Draft for
    `target`, validated against it. Layout: the file's outrider record, else `layout`, else
    inferred (see resolve_layout). Bind the target's embedding before running it."""
    path = Path(path)
    raw = read_config(path)
    layout = resolve_layout(raw, layout)
    cfg = config_from_json(raw, target, layout)
    tensors = read_tensors(path)
    check_tensors(tensors, cfg, path)
    d2t, t2d = resolve_draft_vocab(
        tensors.pop("d2t", None),
        tensors.pop("t2d", None),
        cfg.vocab_size,
        cfg.draft_vocab_size,
        path,
    )
    dtype = dtype or tensors["fc.weight"].dtype
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in it; rotary tables stay fp32
    try:
        with torch.device(device):
            draft = Eagle3Draft(cfg, max_positions)
    finally:
        torch.set_default_dtype(old)
    load_weights(draft, tensors.items())
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft.eval()


def _write_atomically(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    if path.exists():
        _check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = path.parent / f".{path.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if not path.exists():
            tmp.rename(path)
            return path
        old = path.parent / f".{path.name}.old-{tag}"
        path.rename(old)
        try:
            tmp.rename(path)
        except OSError:
            old.rename(path)  # put the previous drafter back
            raise
        shutil.rmtree(old)
        return path
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _check_replaceable(path: Path) -> None:
    if path.is_dir() and not any(path.iterdir()):
        return
    arch: list[str] = []
    with contextlib.suppress(OSError, ValueError):
        arch = json.loads((path / CONFIG_FILE).read_text()).get("architectures") or []
    if not path.is_dir() or not any("Eagle3" in a for a in arch):
        raise FileExistsError(
            f"{str(path)!r} exists and is not an EAGLE-3 drafter directory: save_drafter "
            f"replaces its target whole; pass a new path or remove it first"
        )


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown: pick one of {list(LAYOUTS)}")
