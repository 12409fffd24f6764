"""FP8 block-quantized checkpoints, DeepSeek-V3's release format (and the format transformers'
FineGrainedFP8Config writes): reading `quantization_config`, and dequantizing each weight at
load time, so the model holds plain bf16 (GPU) or fp32 (CPU) weights and needs no FP8 kernel.

The layout, for a linear weight W [out, in] and weight_block_size [b_out, b_in]:

    <name>.weight            float8_e4m3fn [out, in]
    <name>.weight_scale_inv  float32 [ceil(out / b_out), ceil(in / b_in)]   one per block
    W[r, c] = weight[r, c] * weight_scale_inv[r // b_out, c // b_in]

("scale_inv" because the quantizer divided by it; dequantizing multiplies.) Edge blocks are
partial when out or in is no multiple of the block. Tensors the release keeps unquantized
(norms, embeddings, lm_head, the router's gate and its e_score_correction_bias) have no
scale_inv and pass through as stored.

The config, as DeepSeek-V3 ships it: {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}. transformers writes no
"fmt" (e4m3 is implied); "dynamic" activations mean the checkpoint holds no activation scales,
which is what makes weight-only dequantization exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"  # <name>.weight + this = its scale's name
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_SUPPORTED = (
    "quant_method 'fp8' with fmt 'e4m3', activation_scheme 'dynamic' and weight_block_size "
    "[rows, cols] (DeepSeek-V3's release format: float8_e4m3fn weights, one fp32 "
    "weight_scale_inv per block)"
)


@dataclass(frozen=True)
class Fp8BlockScheme:
    """One fp32 scale per `block` = (rows, cols) of each quantized weight."""

    block: tuple[int, int]


def is_fp8(q: Any) -> bool:
    """Whether a config.json `quantization_config` asks for FP8 (valid or not: see below)."""
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() == "fp8"


def parse_fp8_config(q: dict[str, Any]) -> Fp8BlockScheme:
    """An FP8 `quantization_config` -> Fp8BlockScheme, or a ValueError naming the value that
    does not load and what does."""

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"quantized checkpoint not supported: {what}. outrider loads {_SUPPORTED}; use such "
            f"a checkpoint, or the model's bf16 weights"
        )

    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse(f"fp8 fmt {fmt!r}")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise refuse(
            f"fp8 activation_scheme {scheme!r} (activation scales in the checkpoint, for FP8 "
            f"compute)"
        )
    block = q.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise refuse(f"fp8 weight_block_size {block!r} (per-tensor or per-channel scales)")
    return Fp8BlockScheme(block=(block[0], block[1]))


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """weight fp8 [out, in], scale_inv [ceil(out / rows), ceil(in / cols)] -> W float32
    [out, in]: each element times its block's scale, one fp32 product (exact to fp32
    rounding; load_weights then casts once to the model's dtype). Beside the fp32 result it
    allocates only the scales repeated over rows, [out, ceil(in / cols)]."""
    rows, cols = block
    if weight.dim() != 2:
        raise ValueError(
            f"an fp8 weight of shape {tuple(weight.shape)}: block scales are for 2-D weights"
        )
    out, n = weight.shape
    want = (-(-out // rows), -(-n // cols))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a weight "
            f"{(out, n)} in blocks of {list(block)} (want {want}): the config's "
            f"weight_block_size does not match the checkpoint"
        )
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32).repeat_interleave(rows, dim=0)[:out]  # [out, in blocks]
    whole = n // cols * cols
    w[:, :whole].view(out, n // cols, cols).mul_(s[:, : n // cols, None])
    if whole < n:  # the partial last column block
        w[:, whole:].mul_(s[:, -1:])
    return w


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (float8_e4m3fn weight, float32 scale_inv [ceil(out / rows),
    ceil(in / cols)]), scale = block amax / 448. For tests; real checkpoints come quantized."""
    rows, cols = block
    out, n = w.shape
    bo, bi = -(-out // rows), -(-n // cols)
    padded = torch.nn.functional.pad(w.float(), (0, bi * cols - n, 0, bo * rows - out))
    blocks = padded.view(bo, rows, bi, cols)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [bo, bi]
    q = (blocks / scale[:, None, :, None]).view(bo * rows, bi * cols)[:out, :n]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8(
    tensors: Iterable[tuple[str, torch.Tensor]], scheme: Fp8BlockScheme | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as stored -> the same with every fp8 weight dequantized to float32
    and the scales consumed. A weight and its scale may come in either order, shards apart:
    whichever comes first waits, keyed by the weight's name, so what is held is only what
    awaits its pair. At the end an fp8 weight without its scale, or a scale without its fp8
    weight, is an error naming it. With scheme None (a config without an fp8
    quantization_config) any fp8 tensor or scale is an error rather than weights loaded
    unscaled."""
    weights: dict[str, torch.Tensor] = {}  # fp8 weights waiting for their scale
    scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight, by weight name
    for name, tensor in tensors:
        is_scale = name.endswith(SCALE_SUFFIX)
        if (is_scale or tensor.dtype in _FP8_DTYPES) and scheme is None:
            what = "a block scale" if is_scale else tensor.dtype
            raise ValueError(
                f"checkpoint tensor {name} is FP8 ({what}) but config.json has no "
                f"quantization_config with quant_method 'fp8': the config does not match the "
                f"weights; use the checkpoint's own config.json"
            )
        if is_scale:
            key = name[: -len(SCALE_SUFFIX)]
            if key not in weights:
                scales[key] = tensor
                continue
            name, tensor, scale = key, weights.pop(key), tensor
        elif tensor.dtype in _FP8_DTYPES:
            if tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(
                    f"checkpoint tensor {name} is {tensor.dtype}: outrider loads {_SUPPORTED}"
                )
            if name not in scales:
                weights[name] = tensor
                continue
            scale = scales.pop(name)
        else:
            yield name, tensor
            continue
        yield name, dequantize_fp8_block(tensor, scale, scheme.block)
    if weights or scales:
        lone = [f"{n} (no {n}{SCALE_SUFFIX})" for n in weights]
        lone += [f"{n}{SCALE_SUFFIX} (no fp8 {n})" for n in scales]
        raise ValueError(
            f"{len(lone)} FP8 tensor(s) without their pair, e.g. {', '.join(lone[:3])}: every "
            f"float8_e4m3fn weight needs its weight_scale_inv and the reverse; is the checkpoint "
            f"complete (model.safetensors.index.json lists every shard)?"
        )
