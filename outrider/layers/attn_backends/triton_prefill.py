r"""Paged attention for several query tokens per sequence (varlen): prefill chunks over a cached
prefix, chain VERIFY with 1 + k tokens, and tree VERIFY under a tree mask.

Query token i of sequence b (query_len n, context seq_len L) sits at position L - n + i and sees
the keys at positions <= its own, all read through b's block table. With `tree_mask` given
([num_tokens, M] bool, see AttentionMetadata), row t sees every key before L - M instead, and
key j >= L - M iff tree_mask[t, j - (L - M)]: e.g. M = 4, L = 10: keys 0..5 are visible, keys
6..9 read columns 0..3 (with L = 2, keys 0..1 read columns 2..3; columns 0..1 are no key).
M is a runtime argument and the mask's shape does not depend on the context, so a graph
captured once with a mask buffer serves any context.

Grid (batch, kv_heads, q_tiles * num_splits). One program takes BLOCK_Q consecutive query tokens
of one sequence times the `group` query heads of one KV head, as BLOCK_M = BLOCK_Q * GROUP_PAD
rows (row r = token r // GROUP_PAD, head r % GROUP_PAD; GROUP_PAD is group rounded up to a power
of two, the extra heads are masked), so every K/V tile is read once for the whole group.

    group 4, BLOCK_Q 4:  rows  0..3  = token 0, heads 0..3     rows  4..7  = token 1, heads 0..3
                         rows  8..11 = token 2, ...            rows 12..15 = token 3, ...

Causal tiles stop at the tile's last query position, so a chunk of a long prompt never loads
keys beyond what it may see. A VERIFY batch has one q tile per (sequence, KV head), which
alone would leave most SMs idle at small batch and long context; so, like decode, it can split
the key range (num_splits > 1) and merge the partials with the decode module's merge kernel,
so a verify fills the GPU as decode does. Prefill chunks use num_splits 1 and write directly.
A row that sees no key (a padded sequence) comes out 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.layers.attn_backends.triton_decode import (
    LOG2E,
    SplitWorkspace,
    check_paged_inputs,
    dot_precision,
    load_paged_tile,
    merge_splits,
    split_targets,
)

# Query lengths up to this count as VERIFY-sized: few q tiles, worth splitting the key range.
# Trees verify up to this many rows a sequence: at 16, a 17-row tree verify at C=1 ran 27
# programs over the whole context, 21 us a layer on the H200 against 4 us split.
MAX_SPLIT_QUERY_LEN = 128


def prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(target BLOCK_M query rows, BLOCK_N keys, num_warps, num_stages). Picked so that ptxas
    (sm_90, triton 3.6) reports no register spills: bf16 head_dim 128 spills 400+ bytes with
    64 x 64 tiles at 4 warps, none with 64 x 32 at 8; fp32 (IEEE dots) needs 32 x 32 tiles and
    still spills a few hundred bytes under a tree mask. Not yet timed on a GPU: tune here."""
    if dtype == torch.float32:
        return (32, 32, 8, 1) if head_dim >= 128 else (64, 32, 8, 1)
    return (64, 32, 8, 2) if head_dim >= 128 else (64, 64, 8, 2)


def query_tile(max_query_len: int | None, group: int, target_block_m: int) -> tuple[int, int]:
    """(BLOCK_Q tokens, GROUP_PAD heads) per program: BLOCK_Q * GROUP_PAD ~ target_block_m
    rows, at least 16 (tl.dot's minimum), and no more tokens than the longest query needs.
    E.g. group 4, target 64: a verify of 1 + 4 tokens -> (8, 4); a prefill chunk -> (16, 4).
    max_query_len None: no cap, one tile shape for every step (the deterministic mode's)."""
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, target_block_m // group_pad)
    if max_query_len is not None:
        block_q = min(block_q, triton.next_power_of_2(max(max_query_len, 1)))
    block_q = max(block_q, 16 // min(group_pad, 16))
    return block_q, group_pad


def check_ragged_inputs(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    batch: int,
    num_splits: int,
    tree_mask: torch.Tensor | None,
    num_tokens: int,
) -> torch.Tensor | None:
    """Host checks shared by the kernels over ragged queries (prefill and verify, GQA and
    latent); returns the tree mask as they read it (the same bytes as uint8, rows contiguous),
    or None."""
    if query_start_loc.shape[0] != batch + 1 or seq_lens.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: block_tables has {batch} rows, seq_lens {seq_lens.shape[0]}, "
            f"query_start_loc {query_start_loc.shape[0]} (wants batch + 1)"
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if tree_mask is None:
        return None
    check_tree_mask(tree_mask, num_tokens)
    tree_mask = tree_mask.view(torch.uint8)  # same bytes; Triton loads u8 plainly
    return tree_mask if tree_mask.stride(-1) == 1 else tree_mask.contiguous()


def check_tree_mask(tree_mask: torch.Tensor, num_tokens: int) -> None:
    """Host-only (shapes, no values): one bool row per query token, at least one column."""
    if tree_mask.dim() != 2 or tree_mask.shape[0] != num_tokens or tree_mask.shape[1] < 1:
        raise ValueError(
            f"tree_mask has shape {tuple(tree_mask.shape)} for {num_tokens} query tokens; "
            f"build it [{num_tokens}, M] with M >= 1 (one row per query token, over each "
            f"sequence's last M keys: see AttentionMetadata.tree_mask)"
        )
    if tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be torch.bool, got {tree_mask.dtype}")


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,  # host-side bound on query_start_loc's gaps (sizes the grid)
    scale: float,
    num_splits: int = 1,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, M] bool over each sequence's last M keys
    workspace: SplitWorkspace | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """No host sync: lengths are read on the device; `max_query_len` only sizes the grid, so a
    value larger than the true maximum is correct (extra programs find no tokens and exit)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads, group = check_paged_inputs(q, k_cache, v_cache, block_tables)
    batch = block_tables.shape[0]
    tree_mask = check_ragged_inputs(
        query_start_loc, seq_lens, batch, num_splits, tree_mask, num_tokens
    )
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out
    block_m, block_n, num_warps, num_stages = prefill_config(head_dim, q.dtype)
    block_q, group_pad = query_tile(max_query_len, group, block_m)
    q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
    # Every (token, head, split) partial gets written, even an empty one (lse -inf), as long
    # as query_start_loc covers the tokens and max_query_len bounds its gaps.
    dst, dst_strides, lse, lse_strides, workspace = split_targets(out, workspace, num_splits)
    has_mask = tree_mask is not None
    mask = tree_mask if has_mask else seq_lens  # any pointer; unused if causal
    _prefill_kernel[(batch, kv_heads, q_tiles * num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, mask, dst, lse,
        scale * LOG2E, num_splits,
        mask.shape[1] if has_mask else 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        mask.stride(0) if has_mask else 0,
        *dst_strides, *lse_strides,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1], BLOCK_N=block_n, HAS_MASK=has_mask,
        SPLIT=num_splits > 1, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(workspace, out)
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, mask_ptr,
    dst_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    mask_width,  # M: the tree mask covers each sequence's last M keys
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_mt,
    stride_dt, stride_dh, stride_ds,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    first_q = q_tile * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)
    tok = first_q + rows // GROUP_PAD  # token index within the sequence
    g = rows % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    token = q_start + tok  # row of q / out / tree_mask
    head = kv_head * GROUP + g
    pos = seq_len - q_len + tok  # the query's position: it sees keys <= pos
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    # Keys this tile may see: all of the context under a tree mask, else up to its last
    # query's position. A tile past the query (first_q >= q_len) sees nothing.
    if HAS_MASK:
        kv_end = seq_len
        mask_start = seq_len - mask_width  # key of mask column 0; negative if M > seq_len
    else:
        kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(first_q + BLOCK_Q, q_len))
    kv_end = tl.where(first_q < q_len, tl.maximum(kv_end, 0), 0)
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_end)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % PAGE_SIZE
        k = load_paged_tile(
            k_ptr, kv_head, page, slot, dims, key_ok, stride_kh, stride_kb, stride_ks
        )  # [BLOCK_N, HEAD_DIM]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_MASK:
            in_mask = keys >= mask_start  # the last M keys; every earlier one is visible
            col = keys - mask_start
            allowed = tl.load(
                mask_ptr + token[:, None].to(tl.int64) * stride_mt + col[None, :],
                mask=row_ok[:, None] & (key_ok & in_mask)[None, :],
                other=0,
            )
            visible = ((allowed != 0) | ~in_mask[None, :]) & key_ok[None, :]
        else:
            visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        # A row may see nothing in this tile (tree masks, the causal edge, padded rows): keep its
        # running max finite so 2^(s - m) is 0, not NaN.
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = load_paged_tile(
            v_ptr, kv_head, page, slot, dims, key_ok, stride_vh, stride_vb, stride_vs
        )  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    has_keys = l_sum > 0.0
    l_safe = tl.where(has_keys, l_sum, 1.0)
    out = acc / l_safe[:, None]
    dst = dst_ptr + token[:, None] * stride_dt + head[:, None] * stride_dh + split * stride_ds
    tl.store(dst + dims[None, :], out.to(dst_ptr.dtype.element_ty), mask=row_ok[:, None])
    if SPLIT:
        lse = tl.where(has_keys, m + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)
