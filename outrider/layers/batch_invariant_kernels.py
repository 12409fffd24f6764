"""The Triton kernels behind outrider/layers/batch_invariant.py (imported when first used).

A GEMM whose every output row is computed the same way whatever the number of rows: one tile
config for every M, fp32 accumulation over K in one fixed order, and a split of K that depends
on (N, K) alone, its partial sums added in split order by a second kernel (no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def matmul_kernel(
    a_ptr, w_ptr, bias_ptr, c_ptr, part_ptr,
    M, N, K, k_per_split,
    stride_am, stride_wn, stride_cm, stride_pm, stride_ps,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # Grid (N tiles, M tiles, splits): c[m, n] = sum_k a[m, k] w[n, k] over this split's K
    # range, BLOCK_K at a time from its start. Rows past M load as zeros and are not stored:
    # a row's products and their order are the same in every tile it may land in.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_start = split * k_per_split
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Every split walks k_per_split (whole BLOCK_K steps, fixed per layer shape); the last
    # one's steps past K load zeros, which add nothing. A runtime bound, not a constexpr: the
    # loop's order is the same, and one compiled kernel serves every split of a tile config.
    for k0 in range(0, k_per_split, BLOCK_K):
        ks = k_start + k0 + rk
        k_ok = ks < K
        a = tl.load(a_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        part = part_ptr + split * stride_ps + rm.to(tl.int64)[:, None] * stride_pm + rn[None, :]
        tl.store(part, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def reduce_splits_kernel(
    part_ptr, bias_ptr, c_ptr, N,
    stride_pm, stride_ps, stride_cm,
    NUM_SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Grid (M, N blocks): c[m, n] = ((p_0 + p_1) + p_2) + ... + bias, splits in order.
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + m * stride_cm + cols, acc.to(c_ptr.dtype.element_ty), mask=ok)
