"""Batch-invariant forms of the layers whose reductions would otherwise depend on the batch:
the deterministic mode (ModelConfig.deterministic) switches a model's layers to them
(models/deterministic.py).

Why: a GEMM library picks its tiling and split-K by the row count M, and a norm's reduction
kernel by the number of rows, so a row computed alone (a one-token decode) and the same row
inside a verify of 1 + k rows or a prefill chunk take different summation orders; in bf16 the
last bits differ, a near-tie argmax flips, and speculative output forks from plain output.
Here each row's arithmetic depends on that row alone:

- linear / lm_head on CUDA: one Triton GEMM (`matmul`) with one tile config for every M, fp32
  accumulation over K in a fixed order, and a split of K chosen from (N, K) and the device's SM
  count only, its partials added in split order by a second kernel (no atomics). On the CPU,
  each row is its own [1, K] GEMV call.
- RMSNorm on CUDA: the fused one-program-per-row kernel (layers/fused.py), whatever
  OUTRIDER_FUSED_KERNELS says; on the CPU the torch ops one row at a time.
- Already row-local and left alone: the embedding, rotary (the fused kernel runs one program
  per token; torch's ops are elementwise), SiLU-and-mul, the residual adds, greedy argmax.
- Attention is the backends' business (their `deterministic` constructor argument).

The default mode never reaches this module: its layers keep calling their GEMM
(layers/cpu_gemm.py: F.linear, in another form for few rows on the CPU) and their own kernels,
so its speed and bits are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

# Rows per GEMM launch when K is split: the fp32 partials take splits x rows x N x 4 bytes,
# so a long prefill is cut into launches of this many rows (rows are independent, so where
# the cuts fall changes no row's bits).
SPLIT_ROWS_PER_LAUNCH = 1024
# A split of K shorter than this many BLOCK_K steps costs more in partials than it wins.
MIN_K_BLOCKS_PER_SPLIT = 8
MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tile schedule for an [*, K] x [K, N] GEMM: every row count M gets the same one."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int  # K cut into this many ranges, their partials added in order
    k_per_split: int  # whole BLOCK_K steps


# bf16/fp16 tile schedules (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the weight's size,
# fitted to benchmarks/deterministic_gemm.py on the H100 (results/deterministic_gemm_h100.json:
# every candidate at 1, 4, 16, 64 and 256 rows in CUDA graphs, scored by the mean over row
# counts of time over that row count's best). Small weights (the default model's layers, its
# drafter's): narrow 32-wide tiles, many programs for few bytes, within 1-13% of each row
# count's best. Middle (Llama-8B's qkv, o, down): 128 x 128 K steps. Wide ones (LM heads,
# Llama-8B's gate_up): 128 x 128 tiles at 8 warps, which halve the 256-row verify's time.
SMALL_WEIGHT = 1 << 22  # N x K elements
WIDE_N = 24576
TILES_SMALL = (64, 32, 128, 4, 3)
TILES_MIDDLE = (64, 128, 128, 4, 4)
TILES_WIDE = (128, 128, 64, 8, 3)


def gemm_config(dtype: torch.dtype, n: int, k: int, sms: int) -> GemmConfig:
    """The tile schedule of an [*, K] x [K, N] GEMM, chosen from (dtype, N, K, SMs) and never
    by M: the same instruction sequence computes a row in every batch. fp32 (IEEE dots, the
    exactness reference) uses 32s; 16-bit inputs take TILES_SMALL, _MIDDLE or _WIDE by the
    weight's size. K is split so that the N tiles times the splits fill the SMs (split_k)."""
    if dtype == torch.float32:
        bm, bn, bk, warps, stages = 32, 32, 32, 4, 2
    elif n * k <= SMALL_WEIGHT:
        bm, bn, bk, warps, stages = TILES_SMALL
    elif n >= WIDE_N:
        bm, bn, bk, warps, stages = TILES_WIDE
    else:
        bm, bn, bk, warps, stages = TILES_MIDDLE
    splits, per_split = split_k(n, k, sms, bn, bk)
    return GemmConfig(bm, bn, bk, warps, stages, splits, per_split)


def split_k(
    n: int, k: int, num_sms: int, block_n: int, block_k: int, want: int | None = None
) -> tuple[int, int]:
    """(splits, K per split) for an [*, K] x [K, N] GEMM: as many splits as the N tiles fit
    into the SMs whole (a decode's GEMV reads weights at every SM's bandwidth only if every
    SM has a tile), none where the N tiles already fill them; `want` asks for that many
    instead. Capped so a split keeps MIN_K_BLOCKS_PER_SPLIT steps. A function of (N, K, SMs)
    only, so every M gets the same split. Llama-8B shapes on 132 SMs, 128-wide tiles and
    128-long K steps: qkv (6144, 4096) -> 2 of 2048; o_proj (4096, 4096) -> 4 of 1024;
    down_proj (4096, 14336) -> 4 of 3584; the default model's layers -> 1."""
    if want is None:
        want = num_sms // _cdiv(n, block_n)
    most = max(1, k // (MIN_K_BLOCKS_PER_SPLIT * block_k))
    splits = max(1, min(want, most, MAX_SPLITS))
    per_split = _cdiv(_cdiv(k, splits), block_k) * block_k  # whole BLOCK_K steps
    return _cdiv(k, per_split), per_split


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device) -> int:
    """The device's SM count (a stand-in of 8 off CUDA, where the interpreter runs the kernels
    in tests: small enough that the CPU suite sees splits)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def matmul(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K], rows contiguous
    bias: torch.Tensor | None = None,  # [N]
    sms: int | None = None,  # the split choice's SM count (default: the device's)
    config: GemmConfig | None = None,  # a fixed schedule instead of gemm_config's (tuning)
) -> torch.Tensor:  # [M, N], x's dtype
    """x @ weight^T (+ bias) with each row's bits independent of M. No host sync."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"matmul takes x [M, K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(
            f"deterministic linear: x is {x.dtype} but the weight is {weight.dtype}; a "
            f"quantized or mixed-dtype layer has no batch-invariant GEMM yet: run it with "
            f"deterministic=False"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    k_mod = _kernels()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or gemm_config(x.dtype, n, k, sms or num_sms(x.device))
    block_m, block_n, block_k, splits = cfg.block_m, cfg.block_n, cfg.block_k, cfg.splits
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    has_bias = bias is not None
    bias_arg = bias if has_bias else out
    rows = m if splits == 1 else SPLIT_ROWS_PER_LAUNCH
    part = None
    if splits > 1:
        part = torch.empty(splits, min(m, rows), n, dtype=torch.float32, device=x.device)
    for r0 in range(0, m, rows):
        xs, os_ = x[r0 : r0 + rows], out[r0 : r0 + rows]
        mr = xs.shape[0]
        target = part if part is not None else os_
        grid = (-(-n // block_n), -(-mr // block_m), splits)
        k_mod.matmul_kernel[grid](
            xs, weight, bias_arg, os_, target,
            mr, n, k, cfg.k_per_split,
            xs.stride(0), weight.stride(0), os_.stride(0), target.stride(-2),
            target.stride(0) if part is not None else 0,
            HAS_BIAS=has_bias, SPLIT=splits > 1,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        if part is not None:
            k_mod.reduce_splits_kernel[(mr, -(-n // 256))](
                part, bias_arg, os_, n, part.stride(1), part.stride(0), os_.stride(0),
                NUM_SPLITS=splits, HAS_BIAS=has_bias, BLOCK=256,
            )  # fmt: skip
    return out


def linear_rows(
    x: torch.Tensor,  # [T, ..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, ..., N]
    """F.linear one leading index at a time: every row goes through the [1, .., K] call a
    one-token decode makes, whatever else the batch holds. T calls: the CPU's deterministic
    mode pays that in prefill, where a batched GEMM would have run."""
    if x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])


def linear(
    x: torch.Tensor,  # [T, K] (or [T, ..., K] on the CPU)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The deterministic mode's F.linear: the Triton GEMM on CUDA, row by row elsewhere."""
    if not x.is_cuda:
        return linear_rows(x, weight, bias)
    lead = x.shape[:-1]
    return matmul(x.reshape(-1, x.shape[-1]), weight, bias).view(*lead, weight.shape[0])


def rms_norm(
    norm: nn.Module,  # an RMSNorm: its weight, eps and PyTorch form
    x: torch.Tensor,  # [T, ..., N]
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The deterministic mode's RMSNorm: on CUDA the fused kernel (one program per row, one
    summation order for every row count); elsewhere the PyTorch form a row at a time."""
    if x.is_cuda:
        from outrider.layers import fused

        if not fused.triton_ok():
            raise RuntimeError(
                "deterministic=True on CUDA needs triton for its row-invariant kernels: "
                "`pip install 'triton==3.6.*'`, or run with deterministic=False"
            )
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).contiguous()
        res = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
        out = fused.rms_norm(flat, norm.weight.to(x.dtype), norm.eps, res)
        if residual is None:
            return out.view(shape)
        return out[0].view(shape), out[1].view(shape)
    rows = [
        norm.torch_forward(x[i : i + 1], None if residual is None else residual[i : i + 1])
        for i in range(x.shape[0])
    ]
    if residual is None:
        return torch.cat(rows) if rows else norm.torch_forward(x)
    if not rows:
        return norm.torch_forward(x, residual)
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernels():
    """Compiled lazily: importing this module never needs triton."""
    from outrider.layers import batch_invariant_kernels

    return batch_invariant_kernels
