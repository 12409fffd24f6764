"""INT4 weight-only checkpoints in compressed-tensors' "pack-quantized" format, the format of
Kimi-K2(-Thinking) and Kimi-K2.5's routed experts: reading `quantization_config`, unpacking and
dequantizing on the CPU (the reference a fused W4A16 kernel is tested against), and packing
(the inverse, for building test checkpoints).

The layout, as compressed-tensors writes it (`pack_to_int32` / `unpack_from_int32` in
src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py, the same in the
neuralmagic and vllm-project repositories; vLLM reads it as `scalar_types.uint4b8`, "unsigned
4-bit with bias 8", in compressed_tensors_wNa16.py), for a linear weight W [out, in]:

    weight_packed  int32 [out, ceil(in / 8)]   8 values per word along `in`, element 8j + i
                                               in bits 4i .. 4i + 3 (element 8j in the lowest
                                               nibble); each nibble holds q + 8 (offset binary,
                                               not two's complement), q in [-8, 7]; the last
                                               word of a row is zero-padded when in % 8 != 0.
                                               A word whose top nibble is >= 8 reads negative.
    weight_scale   [out, ceil(in / group_size)] one scale per group of `group_size` consecutive
                                               inputs of a row; the checkpoint's dtype (bf16 in
                                               Kimi's releases).
    weight_shape   int [2]                     (out, in) before packing.
    W[r, c] = q[r, c] * weight_scale[r, c // group_size]   (symmetric: no weight_zero_point)

The config, as Kimi-K2-Thinking and Kimi-K2.5 ship it: quant_method "compressed-tensors",
format "pack-quantized", one config group {targets ["Linear"], weights {num_bits 4, type "int",
symmetric true, strategy "group", group_size 32, actorder null}, input_activations null}, and an
`ignore` list keeping lm_head, attention (re:.*self_attn.*), shared experts
(re:.*shared_experts.*) and the dense MLPs (re:.*mlp\\.(gate|up|gate_up|down)_proj.*) in bf16,
so only the routed experts' gate/up/down projections are packed. Kimi's quantization-aware
training leaves q = -8 unused; the format allows it and so does this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

PACK = 8  # int4 values per int32 word
_OFFSET = 8  # stored nibble = q + 8
_SUPPORTED = (
    "compressed-tensors format 'pack-quantized' with weights {num_bits: 4, type: 'int', "
    "symmetric: true, strategy: 'group', group_size > 0} and no activation quantization "
    "(W4A16, as Kimi-K2 and Kimi-K2.5 ship their routed experts)"
)


@dataclass(frozen=True)
class Int4Scheme:
    """What outrider needs from a checkpoint's quantization_config: INT4, symmetric, one scale
    per `group_size` inputs."""

    group_size: int
    num_bits: int = 4


def parse_quantization_config(q: Any) -> Int4Scheme:
    """A config.json `quantization_config` -> Int4Scheme, or a ValueError naming what the
    checkpoint uses, what loads, and what to try instead."""

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"quantized checkpoint not supported: {what}. outrider loads {_SUPPORTED}; use such "
            f"a checkpoint, or the model's bf16 weights"
        )

    if not isinstance(q, dict):
        raise refuse(f"quantization_config is {q!r}, not an object")
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise refuse(
            f"quant_method {method!r} (GPTQ, AWQ... do not load; FP8 blocks load as "
            f"quant_method 'fp8' with a weight_block_size)"
        )
    fmt = q.get("format")
    if fmt != "pack-quantized":
        raise refuse(f"compressed-tensors format {fmt!r}")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("compressed-tensors config without config_groups")
    schemes = set()
    for name, group in groups.items():
        group = group or {}
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise refuse(f"config group {name!r} quantizes {key} (only weight-only loads)")
        w = group.get("weights") or {}
        if w.get("num_bits") != 4 or w.get("type", "int") != "int":
            raise refuse(
                f"config group {name!r} has {w.get('num_bits')}-bit {w.get('type')!r} weights"
            )
        if w.get("symmetric") is not True:
            raise refuse(
                f"config group {name!r} is asymmetric (weight_zero_point); only symmetric "
                f"INT4 loads"
            )
        if w.get("strategy") != "group":
            raise refuse(f"config group {name!r} has strategy {w.get('strategy')!r}")
        size = w.get("group_size")
        if not isinstance(size, int) or size <= 0:
            raise refuse(f"config group {name!r} has group_size {size!r}")
        if w.get("actorder") not in (None, "static"):
            raise refuse(
                f"config group {name!r} has actorder {w['actorder']!r} (a g_idx permutation)"
            )
        schemes.add(Int4Scheme(group_size=size))
    if len(schemes) != 1:
        raise refuse(
            f"config groups with different group sizes {sorted(s.group_size for s in schemes)}"
        )
    return schemes.pop()


def split_unit(group_size: int) -> int:
    """A packed weight's inputs split over ranks only in multiples of this: each rank's slice
    must start on a packed word and on a scale group (Kimi's group 32: 32 inputs)."""
    return math.lcm(group_size, PACK)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [..., n] -> int32 [..., ceil(n / 8)] in the layout above."""
    if q.is_floating_point() or q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError("pack_int4 takes integers in [-8, 7]")
    n = q.shape[-1]
    words = -(-n // PACK)
    nibbles = (q.to(torch.int64) + _OFFSET).reshape(-1, n)
    nibbles = torch.nn.functional.pad(nibbles, (0, words * PACK - n))  # padding: nibble 0
    shifts = torch.arange(PACK, dtype=torch.int64) * 4
    packed = (nibbles.view(-1, words, PACK) << shifts).sum(-1)  # < 2^32: exact in int64
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as int32
    return packed.to(torch.int32).view(*q.shape[:-1], words)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [..., ceil(n / 8)] -> int8 [..., n] in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed INT4 weights are int32, got {packed.dtype}")
    if packed.shape[-1] != -(-n // PACK):
        raise ValueError(
            f"{packed.shape[-1]} packed words per row do not hold {n} values (need {-(-n // PACK)})"
        )
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift; the mask drops the sign
    q = nibbles.flatten(-2)[..., :n] - _OFFSET
    return q.to(torch.int8)


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    n: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """packed [..., ceil(n / 8)], scale [..., ceil(n / group_size)] -> W [..., n] in `dtype`:
    q * scale in float32, then cast (so bf16 weights are the rounded fp32 products)."""
    groups = -(-n // group_size)
    if scale.shape[-1] != groups or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(
            f"scale of shape {tuple(scale.shape)} does not fit packed weights "
            f"{tuple(packed.shape)} with {n} inputs in groups of {group_size} (want "
            f"{(*packed.shape[:-1], groups)})"
        )
    q = unpack_int4(packed, n).to(torch.float32)
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :n]
    return (q * s).to(dtype)


def quantize_int4(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., n] -> (packed int32, scale [..., ceil(n / group_size)]): symmetric round to
    nearest with scale = max |w| / 7 per group (rounded to `scale_dtype` first, so dequantizing
    reproduces exactly what was packed). For tests and random-weight benchmarks; Kimi's own
    weights come from quantization-aware training."""
    n = w.shape[-1]
    groups = -(-n // group_size)
    padded = torch.nn.functional.pad(w.float(), (0, groups * group_size - n))
    grouped = padded.view(*w.shape[:-1], groups, group_size)
    scale = (grouped.abs().amax(-1) / 7).clamp(min=1e-8).to(scale_dtype)
    q = (grouped / scale.float().unsqueeze(-1)).round().clamp(-8, 7)
    q = q.flatten(-2)[..., :n].to(torch.int8)
    return pack_int4(q), scale
