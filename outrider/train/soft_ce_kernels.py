"""The Triton kernels behind outrider/train/soft_ce.py (imported only on the GPU path).

One program per scored row r in [0, B * keep): packed row bi = r // keep, position t = r % keep;
the logits row is bi * T + t, the target row bi * T + t + shift (both contiguous [B, T, V])."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_ce_fwd(
    z_ptr, p_ptr, ce_ptr, lse_ptr, mass_ptr, arg_ptr, T, keep, shift, V: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    bi, t = r // keep, r % keep
    z_row = z_ptr + (bi * T + t) * V
    p_row = p_ptr + (bi * T + t + shift) * V
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.full([], 0.0, tl.float32)  # running sum of exp(z - m)
    pz = tl.full([], 0.0, tl.float32)
    mass = tl.full([], 0.0, tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        idx = start + cols
        ok = idx < V
        z = tl.load(z_row + idx, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.load(p_row + idx, mask=ok, other=0.0).to(tl.float32)
        block_max = tl.max(z, axis=0)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        pz += tl.sum(tl.where(ok, p * z, 0.0), axis=0)
        mass += tl.sum(p, axis=0)
        # The first index of the largest value, as torch.argmax: a later block must beat it.
        i = tl.argmax(z, axis=0, tie_break_left=True).to(tl.int64) + start
        better = block_max > best
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, block_max, best)
    lse = m + tl.log(s)
    tl.store(ce_ptr + r, mass * lse - pz)
    tl.store(lse_ptr + r, lse)
    tl.store(mass_ptr + r, mass)
    tl.store(arg_ptr + r, best_i)


@triton.jit
def soft_ce_bwd(
    z_ptr, p_ptr, lse_ptr, mass_ptr, g_ce_ptr, g_lse_ptr, grad_ptr, T, keep, shift, V: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # d/dz of g_ce * ce + g_lse * lse = (g_ce * mass + g_lse) * softmax(z) - g_ce * p
    r = tl.program_id(0).to(tl.int64)
    bi, t = r // keep, r % keep
    z_row = z_ptr + (bi * T + t) * V
    g_row = grad_ptr + (bi * T + t) * V
    p_row = p_ptr + (bi * T + t + shift) * V
    lse = tl.load(lse_ptr + r)
    g_ce = tl.load(g_ce_ptr + r)
    coef = g_ce * tl.load(mass_ptr + r) + tl.load(g_lse_ptr + r)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        ok = idx < V
        z = tl.load(z_row + idx, mask=ok, other=0.0).to(tl.float32)
        p = tl.load(p_row + idx, mask=ok, other=0.0).to(tl.float32)
        g = coef * tl.exp(z - lse) - g_ce * p
        tl.store(g_row + idx, g.to(grad_ptr.dtype.element_ty), mask=ok)
