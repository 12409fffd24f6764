"""Checkpoint tensors -> model parameters, through each parameter's `weight_loader`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from outrider.models.protocol import PagedModel

log = logging.getLogger(__name__)

# Checkpoint entries that are derived at run time, not parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

# `map_weight_name`'s answer for a checkpoint tensor the model does not use.
SKIP = ("skip", None)


def load_weights(model: PagedModel, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load every parameter of `model` or fail naming what is missing.

    Packed parameters (qkv_proj, gate_up_proj) receive their checkpoint shards one at a time via
    the model's `packed_modules_mapping`; tied parameters (lm_head = embedding) load once. A
    model whose checkpoint names need more than that (stacked experts, a name prefix, tensors
    to skip) answers them in `map_weight_name(name)`: (parameter name, shard id), a new
    checkpoint name (then mapped as usual), SKIP, or None (the usual mapping). A parameter
    whose shards are not in the packed table lists them in `param.expected_shards`. Then
    every submodule with an `after_load()` derives what its forward needs from its weights.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = model.packed_modules_mapping
    tied = model.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and name == "lm_head.weight":
            continue  # some tied checkpoints store a copy; the embedding is the source of truth
        mapped = model.map_weight_name(name)
        if mapped is SKIP:
            continue
        if isinstance(mapped, str):  # renamed; the packed table still applies
            name, mapped = mapped, None
        target, shard = mapped or (name, None)
        for ckpt_name, (packed_name, shard_id) in packed.items() if mapped is None else ():
            if f".{ckpt_name}." in name:
                target, shard = name.replace(f".{ckpt_name}.", f".{packed_name}."), shard_id
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        tensor = tensor.to(dtype=param.dtype)
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            if param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(param.shape)}: the checkpoint does not match its config"
                )
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(f"{target}#{shard}")
    if unexpected:
        log.warning(
            "ignored %d checkpoint tensors with no parameter: %s", len(unexpected), unexpected[:5]
        )
    missing = []
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        shards = getattr(params[name], "expected_shards", None) or [
            s
            for n, (p, s) in packed.items()
            if name.endswith(f".{p}.weight") or name.endswith(f".{p}.bias")
        ]
        if f"{name}#None" in loaded:  # loaded whole (a checkpoint that stores it stacked)
            continue
        need = [f"{name}#{s}" for s in shards] if shards else [f"{name}#None"]
        missing += [n for n in need if n not in loaded]
    if missing:
        raise ValueError(
            f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:4]}: "
            f"is it complete and for this architecture ({type(model).__name__})?"
        )
    for module in model.modules():  # what layers derive from their loaded weights
        after_load = getattr(module, "after_load", None)
        if callable(after_load):
            after_load()
