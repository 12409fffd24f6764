r"""Paged decode attention in Triton: one query token per sequence, split along the context
(flash-decoding), grouped by KV head.

Stage 1, grid (batch, kv_heads, num_splits). Program (b, g, s) loads the `group` query heads
that share KV head g once ([BLOCK_H, head_dim], padded to 16 rows for tl.dot), walks its slice
of sequence b's context in tiles of BLOCK_N keys, and reads each K/V row of KV head g exactly
once for the whole group: GQA costs no extra memory traffic. A tile's keys may span pages; each
key finds its page through the block table (one int32 gather per tile, served from cache).
It writes the slice's normalised output and its log2-sum-exp, in fp32.

Stage 2, grid (rows, num_heads): merges the num_splits partials of a row and head with the usual
max-rescaled weights. `prefill_attention` (triton_prefill.py) reuses it.

Worked example, seq_len 300, num_splits 4, BLOCK_N 64: split_len = ceil(ceil(300/4) / 64) * 64
= 128, so the splits cover [0,128) [128,256) [256,300) and [384..) = nothing. An empty split (or
a padded row with seq_len 0) stores lse = -inf and zeros, which the merge weighs 0, so a row
whose every split is empty comes out exactly 0, never NaN (CUDA graphs pad batches so).

num_splits only shapes the grid: every program derives its slice from the device-side seq_len,
so a graph captured with a fixed num_splits serves any context (longer contexts just make each
slice longer). It is chosen on the host from host-side lengths (`choose_num_splits`), never
from device values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A split shorter than this costs more in merging than it wins in parallelism.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32


def choose_num_splits(
    programs: int,
    max_seq_len: int,
    num_sms: int,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
    max_splits: int = MAX_SPLITS,
) -> int:
    """Splits per (row, KV head) so that `programs * splits` covers about two waves of the SMs,
    without slicing the longest context finer than `min_tokens_per_split`. Host ints only.

    Llama-8B shape (8 KV heads) on 132 SMs: B=1, ctx 8K -> 32 splits of 256 keys; B=32,
    ctx 1K -> 2; B=64 -> 1 (512 programs already fill the machine)."""
    want = -(-2 * num_sms // max(programs, 1))
    cap = -(-max(max_seq_len, 1) // min_tokens_per_split)
    return max(1, min(want, cap, max_splits))


def decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N keys a tile, num_warps, num_stages). Picked so that ptxas (sm_90, triton 3.6)
    reports no register spills: bf16 head_dim 128 at 4 warps and 64 keys needs 255 registers
    and spills, 8 warps needs 210; fp32 (IEEE dots, twice the bytes) needs 32-key tiles and a
    single stage. Not yet timed on a GPU: tune here."""
    if dtype == torch.float32:
        return 32, 8 if head_dim >= 128 else 4, 1
    return 64, 8 if head_dim >= 128 else 4, 2


@dataclass
class SplitWorkspace:
    """fp32 partials of split attention; allocated once per step and reused by every layer."""

    out: torch.Tensor  # [rows, num_heads, num_splits, head_dim] float32
    lse: torch.Tensor  # [rows, num_heads, num_splits] float32, log2 domain

    @classmethod
    def allocate(
        cls, rows: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> SplitWorkspace:
        f32 = torch.float32
        return cls(
            torch.empty(rows, num_heads, num_splits, head_dim, dtype=f32, device=device),
            torch.empty(rows, num_heads, num_splits, dtype=f32, device=device),
        )

    def fits(self, rows: int, num_heads: int, num_splits: int, head_dim: int) -> bool:
        return tuple(self.out.shape) == (rows, num_heads, num_splits, head_dim)


def split_targets(
    out: torch.Tensor,  # [rows, num_heads, dim]: the final output
    workspace: SplitWorkspace | None,
    num_splits: int,
) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor, tuple[int, ...], SplitWorkspace | None]:
    """Where a split kernel writes: with one slice `out` itself (split stride 0, no lse), else
    the fp32 partials of `workspace` (reused when it fits, allocated when not), which
    merge_splits then reduces into `out`. Returns (dst, dst_strides, lse, lse_strides,
    workspace)."""
    if num_splits == 1:
        return out, (*out.stride()[:2], 0), out, (0, 0), None
    rows, num_heads, dim = out.shape
    if workspace is None or not workspace.fits(rows, num_heads, num_splits, dim):
        workspace = SplitWorkspace.allocate(rows, num_heads, num_splits, dim, out.device)
    out_strides, lse_strides = workspace.out.stride()[:3], workspace.lse.stride()[:2]
    return workspace.out, out_strides, workspace.lse, lse_strides, workspace


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would get TF32 tensor cores by default (~1e-3 relative error); the fp32 path
    is the exactness reference, so it pays for IEEE products. bf16/fp16 are unaffected."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_paged_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int]:
    """Shape checks shared by both kernels (host metadata only). Returns (kv_heads, group)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if k_cache.shape != v_cache.shape or cache_dim != head_dim:
        raise ValueError(
            f"KV cache shapes k={tuple(k_cache.shape)} v={tuple(v_cache.shape)} do not match "
            f"q's head_dim {head_dim}: expected [num_blocks, block_size, kv_heads, {head_dim}]"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} unsupported: the kernels need a power of two >= 16")
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("the KV cache and block table need a contiguous last dimension")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    return kv_heads, num_heads // kv_heads


def decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, 0 for padded rows (they come out 0)
    scale: float,
    num_splits: int,
    workspace: SplitWorkspace | None = None,
) -> torch.Tensor:  # [B, num_heads, head_dim], q's dtype
    """Attention of each sequence's one query to its first seq_lens[b] cached keys. No host
    sync: every length is read on the device. `workspace` (fits B, heads, num_splits) avoids an
    allocation per layer; without it one is made."""
    batch, num_heads, head_dim = q.shape
    kv_heads, group = check_paged_inputs(q, k_cache, v_cache, block_tables)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"decode takes one query per sequence: q has {batch} rows, block_tables "
            f"{block_tables.shape[0]}, seq_lens {seq_lens.shape[0]} (multi-token queries go to "
            f"prefill_attention)"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_h = max(16, triton.next_power_of_2(group))
    block_n, num_warps, num_stages = decode_config(head_dim, q.dtype)
    dst, dst_strides, lse, lse_strides, workspace = split_targets(out, workspace, num_splits)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, dst, lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *dst_strides, *lse_strides,
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_N=block_n, SPLIT=num_splits > 1, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(workspace, out)
    return out


def merge_splits(workspace: SplitWorkspace, out: torch.Tensor) -> None:
    """out[r, h] = sum_s w_s * part[r, h, s] / sum_s w_s, w_s = 2^(lse_s - max lse). Rows whose
    splits are all empty (lse -inf everywhere) get 0."""
    rows, num_heads, num_splits, head_dim = workspace.out.shape
    _merge_splits_kernel[(rows, num_heads)](
        workspace.out, workspace.lse, out, num_splits,
        *workspace.out.stride()[:3], *workspace.lse.stride()[:2], *out.stride()[:2],
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
    )  # fmt: skip


@triton.jit
def load_paged_tile(ptr, kv_head, page, slot, dims, key_ok, stride_h, stride_b, stride_s):
    """One [BLOCK_N, HEAD_DIM] tile of a K or V cache: row i is key i's head `kv_head`, found
    at (page[i], slot[i]); rows past the context (key_ok False) load as zeros. Shared by the
    decode and prefill kernels so both walk pages the same way."""
    rows = ptr + kv_head * stride_h + page * stride_b + slot * stride_s
    return tl.load(rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, dst_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain (exp2 is one MUFU op)
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_db, stride_dh, stride_ds,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + b)
    # Slices are whole tiles, so only a sequence's last tile is ragged.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < GROUP
    q_head = kv_head * GROUP + heads
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + q_head[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )  # [BLOCK_H, HEAD_DIM]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        # int64 page offsets: a layer's cache can pass 2^31 elements.
        page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % PAGE_SIZE
        k = load_paged_tile(
            k_ptr, kv_head, page, slot, dims, key_ok, stride_kh, stride_kb, stride_ks
        )  # [BLOCK_N, HEAD_DIM]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid key (n0 < end), so m_new is finite and nothing is NaN.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = load_paged_tile(
            v_ptr, kv_head, page, slot, dims, key_ok, stride_vh, stride_vb, stride_vs
        )  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    has_keys = l_sum > 0.0
    l_safe = tl.where(has_keys, l_sum, 1.0)
    out = acc / l_safe[:, None]
    dst = dst_ptr + b * stride_db + q_head[:, None] * stride_dh + split * stride_ds + dims[None, :]
    tl.store(dst, out.to(dst_ptr.dtype.element_ty), mask=head_ok[:, None])
    if SPLIT:
        lse = tl.where(has_keys, m + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + q_head * stride_lh + split, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pr, stride_ph, stride_ps,
    stride_lr, stride_lh,
    stride_or, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(
        lse_ptr + row * stride_lr + head * stride_lh + splits, mask=split_ok, other=float("-inf")
    )
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all empty: weights 2^-inf = 0, no NaN
    w = tl.exp2(lse - top)  # [BLOCK_S]
    part = tl.load(
        part_ptr + row * stride_pr + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
        mask=split_ok[:, None],
        other=0.0,
    )  # [BLOCK_S, HEAD_DIM]
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * stride_or + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))
