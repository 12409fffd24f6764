"""The Triton kernels behind outrider/layers/fused.py (imported only when one is first used)."""

from __future__ import annotations

import triton
import triton.language as tl


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


@triton.jit
def rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, stride_x, stride_res, n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row. out and res_out are contiguous [rows, n].
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like `x + residual`
        tl.store(res_out_ptr + row * n + cols, x, mask=ok)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    normed = (h * inv).to(x.dtype)  # rounded before the weight multiply, as the torch path
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(x.dtype), mask=ok)


@triton.jit
def rotary_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_cos,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    # One program per token; q heads then k heads sit back to back at the row's start, each
    # head_dim = 2 * HALF wide, rotate-half pairs (i, i + HALF).
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + dims)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + dims)[None, :]
    heads = tl.arange(0, HEADS_PAD)[:, None]
    ok = heads < HEADS
    base = qkv_ptr + t * stride_t + heads * (2 * HALF) + dims[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base, (a * cos - b * sin).to(x1.dtype), mask=ok)
    tl.store(base + HALF, (b * cos + a * sin).to(x1.dtype), mask=ok)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + t * stride_x + inter + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # rounded like F.silu's output
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, out.to(g.dtype), mask=ok)


@triton.jit
def top_logprobs_partial_kernel(
    x_ptr, stride_x, vocab, chunk, cand_v_ptr, cand_i_ptr, max_ptr, sum_ptr,
    T: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (row, part) reads its chunk of the row once: the chunk's max and sum of
    # exp(x - max) (for the row's logsumexp), and its T largest values, descending, ties to
    # the lower index. Written to [rows, parts] and [rows, parts, T].
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    offs = tl.arange(0, BLOCK)
    cols = part * chunk + offs
    ok = (offs < chunk) & (cols < vocab)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.where(ok, tl.exp(x - m_safe), 0.0), 0)
    slot = row * parts + part
    tl.store(max_ptr + slot, m)
    tl.store(sum_ptr + slot, s)
    for j in tl.static_range(T):
        v = tl.max(x, 0)
        i = tl.min(tl.where((x == v) & ok, cols, vocab), 0)
        tl.store(cand_v_ptr + slot * T + j, v)
        tl.store(cand_i_ptr + slot * T + j, i)
        x = tl.where(cols == i, float("-inf"), x)


@triton.jit
def top_logprobs_merge_kernel(
    cand_v_ptr, cand_i_ptr, max_ptr, sum_ptr, out_v_ptr, out_i_ptr, parts, vocab,
    T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # One program per row: the row's logsumexp from its parts, then the T best of the parts'
    # candidates (ties to the lower index), as log-probabilities.
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    pok = p < parts
    m = tl.load(max_ptr + row * parts + p, mask=pok, other=float("-inf"))
    s = tl.load(sum_ptr + row * parts + p, mask=pok, other=0.0)
    top = tl.max(m, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    lse = top_safe + tl.log(tl.sum(s * tl.exp(m - top_safe), 0))
    c = tl.arange(0, BLOCK_C)
    cok = c < parts * T
    v = tl.load(cand_v_ptr + row * parts * T + c, mask=cok, other=float("-inf"))
    ids = tl.load(cand_i_ptr + row * parts * T + c, mask=cok, other=vocab)
    for j in tl.static_range(T):
        best = tl.max(v, 0)
        i = tl.min(tl.where(v == best, ids, vocab), 0)
        tl.store(out_v_ptr + row * T + j, best - lse)
        tl.store(out_i_ptr + row * T + j, i.to(tl.int64))
        v = tl.where(ids == i, float("-inf"), v)


@triton.jit
def move_slots_kernel(
    pool_ptr, src_ptr, dst_ptr, moves, stride_layer, width,
    M_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    # One program per (layer, column chunk) moves every slot's chunk: all sources are loaded,
    # the block waits, then all destinations are written, so a destination that is also a
    # source is read first. Programs touch disjoint (layer, column) regions.
    layer = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    m = tl.arange(0, M_PAD)
    ok_m = m < moves
    src = tl.load(src_ptr + m, mask=ok_m, other=0).to(tl.int64)
    dst = tl.load(dst_ptr + m, mask=ok_m, other=0).to(tl.int64)
    ok = ok_m[:, None] & (cols < width)[None, :]
    base = pool_ptr + layer * stride_layer
    vals = tl.load(base + src[:, None] * width + cols[None, :], mask=ok)
    tl.debug_barrier()
    tl.store(base + dst[:, None] * width + cols[None, :], vals, mask=ok)
