"""EAGLE-3 drafters on disk, in the layouts SGLang and vLLM load (SpecForge writes SGLang's) and
the `speculators` library's (vLLM loads it natively; RedHatAI's published speculators use it).

A drafter directory holds `config.json` (an HF Llama config, architectures
["LlamaForCausalLMEagle3"], plus vocab_size / draft_vocab_size / target_hidden_size and the aux
layer ids; speculators nests the Llama fields under transformer_layer_config, see
eagle3_format.py) and `model.safetensors` with unpacked HF tensor names:

    fc.weight                                   [H, 3 * Ht]
    <layer>.{input_layernorm,hidden_norm,post_attention_layernorm}.weight      [H]
    <layer>.self_attn.{q,k,v}_proj.weight       [heads * hd | kv * hd, 2H]
    <layer>.self_attn.o_proj.weight             [H, heads * hd]
    <layer>.mlp.{gate,up}_proj.weight [I, H]    <layer>.mlp.down_proj.weight [H, I]
    norm.weight [H]    lm_head.weight [draft_vocab, H]    d2t int64 [draft_vocab]    t2d bool [vocab]

<layer> is `midlayer` for SGLang (its LlamaForCausalLMEagle3 has a `midlayer` module and drops
names it does not know without a word, so `layers.0.*` would load as random weights) and
`layers.0` for vLLM and speculators (their models keep the layer in `layers`; vLLM's loader also
renames `midlayer.` to `layers.0.`). Loading accepts both, with or without a `model.` prefix.
The target's embedding is shared, never stored; a shipped `embed_tokens.weight` (speculators
saves one) is ignored, and so are speculators' training-only `verifier_norm` / `verifier_lm_head`.

Aux layer ids: see `engine_aux_ids`. Invariant: save -> load returns bit-identical parameters,
d2t, t2d and aux_layers for every layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from outrider.device import default_dtype
from outrider.distributed import TPGroup
from outrider.loaders.hf_config import ModelConfig
from outrider.models.eagle3 import Eagle3Config, Eagle3Draft

# The config side lives in eagle3_format; its names are re-exported here for callers.
from outrider.models.eagle3_format import (
    ARCHITECTURE,
    CONFIG_FILE,
    LAYER_PREFIX,
    LAYOUTS,
    WEIGHTS_FILE,
    aux_layers_from_config,
    check_layout,
    config_from_json,
    config_json,
    engine_aux_ids,
    explicit_aux_ids,
    outrider_aux_layers,
    read_config,
    resolve_layout,
)
from outrider.models.weights import load_weights
from outrider.speculative.eagle3_vocab import resolve_draft_vocab

log = logging.getLogger(__name__)


__all__ = [
    "ARCHITECTURE", "CONFIG_FILE", "LAYOUTS", "WEIGHTS_FILE", "aux_layers_from_config",
    "check_tensors", "config_from_json", "engine_aux_ids", "expected_shapes",
    "explicit_aux_ids", "load_drafter", "outrider_aux_layers", "read_config", "read_tensors",
    "resolve_layout", "save_drafter",
]  # fmt: skip


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


# speculators' copy of the target's final norm and (draft-vocabulary rows of the) lm_head: the
# training loss's reference, never part of the drafter (speculators itself skips them on save).
_TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")


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
    for name in _TRAINING_ONLY:
        out.pop(name, None)
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
    check_layout(layout)
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
    prefix = LAYER_PREFIX[layout]
    # clone: split views share storage, which safetensors refuses.
    tensors = {
        (prefix + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v.clone()
        for k, v in sd.items()
    }
    config = config_json(cfg, layout, extra, sd["fc.weight"].dtype)
    return _write_atomically(Path(path), config, tensors)


def load_drafter(
    path: str | Path,
    target: ModelConfig,
    layout: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,  # None: the stored dtype
    max_positions: int | None = None,
    tp: TPGroup | None = None,
) -> Eagle3Draft:
    """A drafter directory (ours, SpecForge's, SGLang's, vLLM's or speculators') -> an
    Eagle3Draft for `target`, validated against it. Aux-id convention: a speculators file's
    (vLLM's), else the file's outrider record, else `layout`, else inferred (see
    resolve_layout). Bind the target's embedding before running it. tp: the group to split it
    over (this rank's shard is loaded; None: whole)."""
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
    with default_dtype(dtype), torch.device(device):  # rotary tables stay fp32
        draft = Eagle3Draft(cfg, max_positions, tp)
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
