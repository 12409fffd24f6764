r"""Weight-absorbed multi-head latent attention (MLA) in Triton, over the paged latent cache:
DECODE and chain/tree VERIFY of DeepSeek-V3 / Kimi-K2, graph-capturable.

Each cached token is one row [c | k_pe]: c the normalised compressed KV (r = kv_lora_rank
values, 512 in the real models), k_pe the roped shared key (d_r = qk_rope_head_dim, 64). Every
query head h of token t attends to the same rows (multi-query attention, one KV head):

    score(t, h, j) = scale * (q[t, h, :r] . c_j + q[t, h, r:] . k_pe_j)      value_j = c_j

r and d_r are powers of two but r + d_r (576) is not, so the score is two dot products (one
over c, one over k_pe) instead of one over a tile padded to 1024 columns; the c tile loaded
for the scores is the value tile too, so each latent is read once per program.

Grid (batch, max_query_len * head_tiles, num_splits). Program (b, i * head_tiles + g, s) takes
query token i of sequence b (if i < its query_len) and BLOCK_H of its heads, g-th tile:

    heads 40, BLOCK_H 16 -> head_tiles 3: heads 0..15, 16..31, 32..39 (+ 8 masked rows)

so one pass over the sequence's latents serves BLOCK_H heads (the point of MQA: at 128 heads,
8 passes instead of 128). It walks its split of the keys the token may see in tiles of BLOCK_N
through the block table, with an online softmax in fp32, and writes the split's normalised
output [BLOCK_H, r] and log2-sum-exp; triton_decode's merge kernel combines the splits.

Visibility, as triton_prefill.py (query token i of a sequence with query_len Q, seq_len L
sits at position L - Q + i): causal, it sees keys 0 .. L - Q + i; under a tree mask
([num_tokens, M] bool) it sees every key before L - M and key L - M + j iff mask[t, j].

Every length is read on the device (seq_lens, query_start_loc, block_tables); the grid
depends only on host data the backend derives once per step (batch, max_query_len, splits),
so a CUDA graph captured once serves any context. A padded row (seq_len 0, or a token past its
sequence's query_len) sees nothing and comes out 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from outrider.layers.attn_backends.triton_decode import (
    LOG2E,
    SplitWorkspace,
    dot_precision,
    merge_splits,
    split_targets,
)
from outrider.layers.attn_backends.triton_prefill import check_ragged_inputs

# Query heads a program takes: tl.dot's minimum M, and what keeps the fp32 accumulator
# [BLOCK_H, 512] at 64 registers a thread over 4 warps.
BLOCK_H = 16


def mla_config(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N keys a tile, num_warps, num_stages). bf16: a [32, 576] latent tile is 36 KB a
    stage; fp32 (IEEE dots, twice the bytes) halves the tile and keeps one stage.

    Timed on the H200 (bf16, r 512, d_r 64, 4K contexts, one layer's write + attention +
    merge replayed in a CUDA graph): 128 heads, B=1 22 us; B=32 354 us, ~100 TFLOP/s, bound by
    the 16-row MMA tiles; 16 heads, B=32 76 us (2 TB/s of latents). BLOCK_H 32 or 64 with 8
    warps saved up to 30% at 128 heads and B >= 32 but lost at B=1 and at 16 heads; BLOCK_N
    64 gained nothing. A larger step needs wgmma-sized head tiles (FlashMLA's layout)."""
    if dtype == torch.float32:
        return 16, 4, 1
    return 32, 4, 2


def latent_dims(width: int, v_dim: int) -> tuple[int, int]:
    """(r, d_r) of a latent row `width` wide whose first v_dim columns are the values; raises
    unless both are powers of two (r >= 16, tl.dot's minimum)."""
    r, d_r = v_dim, width - v_dim
    if r < 16 or r & (r - 1):
        raise ValueError(
            f"kv_lora_rank {r} unsupported by the Triton MLA kernel: it needs a power of two "
            f">= 16 (DeepSeek-V3 and Kimi-K2 use 512); use attention_backend='torch_ref'"
        )
    if d_r < 1 or d_r & (d_r - 1):
        raise ValueError(
            f"qk_rope_head_dim {d_r} (latent width {width} - kv_lora_rank {r}) unsupported by "
            f"the Triton MLA kernel: it needs a power of two (DeepSeek-V3 and Kimi-K2 use 64); "
            f"use attention_backend='torch_ref'"
        )
    return r, d_r


def head_tiles(num_heads: int) -> int:
    return triton.cdiv(num_heads, BLOCK_H)


def latent_attention(
    q_lat: torch.Tensor,  # [num_tokens, num_heads, r]: q_nope @ W_UK per head
    q_pe: torch.Tensor,  # [num_tokens, num_heads, d_r]: the roped query
    cache: torch.Tensor,  # [num_blocks, block_size, r + d_r]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,  # host-side bound on query_start_loc's gaps (sizes the grid)
    scale: float,
    num_splits: int = 1,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, M] bool over each sequence's last M keys
    workspace: SplitWorkspace | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, r], q's dtype
    """No host sync: lengths are read on the device; `max_query_len` only sizes the grid, so a
    value above the true maximum is correct (the extra programs find no token). `workspace`
    (fits num_tokens, heads, num_splits, r) avoids an allocation per layer. The query is
    [q_lat | q_pe] per head, read from its two parts. The values are each cached row's first
    r columns."""
    num_tokens, num_heads, r = q_lat.shape
    if q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(
            f"query parts of shapes {tuple(q_lat.shape)} and {tuple(q_pe.shape)}: both need "
            f"[num_tokens, num_heads, ...]"
        )
    width = r + q_pe.shape[-1]
    r, d_r = latent_dims(width, r)
    batch = block_tables.shape[0]
    if cache.dim() != 3 or cache.shape[-1] != width:
        raise ValueError(
            f"latent cache of shape {tuple(cache.shape)} for queries {width} wide: expected "
            f"[num_blocks, block_size, {width}]"
        )
    if q_lat.dtype != cache.dtype or q_pe.dtype != cache.dtype:
        raise ValueError(
            f"dtypes differ: q {q_lat.dtype} / {q_pe.dtype}, latent cache {cache.dtype}"
        )
    if cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("the latent cache and block table need a contiguous last dimension")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    tree_mask = check_ragged_inputs(
        query_start_loc, seq_lens, batch, num_splits, tree_mask, num_tokens
    )
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    out = torch.empty(num_tokens, num_heads, r, dtype=q_lat.dtype, device=q_lat.device)
    if num_tokens == 0 or batch == 0:
        return out
    # Every (token, head, split) partial gets written, an empty one too (lse -inf), as long as
    # query_start_loc covers the tokens and max_query_len bounds its gaps.
    dst, dst_strides, lse, lse_strides, workspace = split_targets(out, workspace, num_splits)
    block_n, num_warps, num_stages = mla_config(q_lat.dtype)
    has_mask = tree_mask is not None
    mask = tree_mask if has_mask else seq_lens  # any pointer; unused if causal
    tiles = head_tiles(num_heads)
    _mla_kernel[(batch, max(max_query_len, 1) * tiles, num_splits)](
        q_lat, q_pe, cache, block_tables, seq_lens, query_start_loc, mask, dst, lse,
        scale * LOG2E, num_splits, mask.shape[1] if has_mask else 0,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0),
        mask.stride(0) if has_mask else 0,
        *dst_strides, *lse_strides,
        NUM_HEADS=num_heads, HEAD_TILES=tiles, BLOCK_H=BLOCK_H, R=r, D_R=d_r,
        PAGE_SIZE=cache.shape[1], BLOCK_N=block_n, HAS_MASK=has_mask, SPLIT=num_splits > 1,
        DOT_PRECISION=dot_precision(q_lat.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(workspace, out)
    return out


@triton.jit
def _mla_kernel(
    q_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, mask_ptr,
    dst_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    num_splits,
    mask_width,  # M: the tree mask covers each sequence's last M keys
    stride_qt, stride_qh, stride_pt, stride_ph, stride_cb, stride_cs, stride_bt, stride_mt,
    stride_dt, stride_dh, stride_ds,
    stride_lt, stride_lh,
    NUM_HEADS: tl.constexpr, HEAD_TILES: tl.constexpr, BLOCK_H: tl.constexpr,
    R: tl.constexpr, D_R: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    tok = tl.program_id(1) // HEAD_TILES  # query token within the sequence
    head_tile = tl.program_id(1) % HEAD_TILES
    split = tl.program_id(2)

    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    valid = tok < q_len
    token = q_start + tok  # row of q / out / tree_mask (only read or written if valid)

    # Keys this token may see: the whole context under a tree mask (the mask decides within
    # its last M keys), else up to its own position seq_len - q_len + tok.
    if HAS_MASK:
        kv_end = seq_len
        mask_start = seq_len - mask_width  # key of mask column 0; negative if M > seq_len
    else:
        kv_end = seq_len - q_len + tok + 1
    kv_end = tl.where(valid, tl.maximum(kv_end, 0), 0)
    # Slices are whole tiles, so only a token's last tile is ragged.
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_end)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = (heads < NUM_HEADS) & valid
    dims = tl.arange(0, R)
    rope = tl.arange(0, D_R)
    q_row = q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_row + dims[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, R]
    pe_row = q_pe_ptr + token.to(tl.int64) * stride_pt + heads[:, None] * stride_ph
    q_pe = tl.load(pe_row + rope[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, D_R]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    table = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        # int64 page offsets: a layer's cache can pass 2^31 elements.
        page = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cb + (keys % PAGE_SIZE) * stride_cs
        c = tl.load(rows[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)  # [N, R]
        k_pe = tl.load(rows[:, None] + R + rope[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        if D_R >= 16:
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        else:  # below tl.dot's minimum K (tiny test models): a broadcast product
            prod = q_pe.to(tl.float32)[:, None, :] * k_pe.to(tl.float32)[None, :, :]
            s += tl.sum(prod, 2)
        s = s * qk_scale
        visible = key_ok
        if HAS_MASK:
            in_mask = keys >= mask_start  # the last M keys; every earlier one is visible
            allowed = tl.load(
                mask_ptr + token.to(tl.int64) * stride_mt + (keys - mask_start),
                mask=key_ok & in_mask & valid,
                other=0,
            )
            visible = key_ok & ((allowed != 0) | ~in_mask)
        s = tl.where(visible[None, :], s, float("-inf"))
        # A tree mask can hide a whole tile from a token: keep the running max finite so
        # 2^(s - m) is 0, not NaN.
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m = m_new

    has_keys = l_sum > 0.0
    l_safe = tl.where(has_keys, l_sum, 1.0)
    out = acc / l_safe[:, None]
    dst = dst_ptr + token.to(tl.int64) * stride_dt + heads[:, None] * stride_dh + split * stride_ds
    tl.store(dst + dims[None, :], out.to(dst_ptr.dtype.element_ty), mask=head_ok[:, None])
    if SPLIT:
        lse = tl.where(has_keys, m + tl.log2(l_safe), float("-inf"))
        lse_dst = lse_ptr + token.to(tl.int64) * stride_lt + heads * stride_lh + split
        tl.store(lse_dst, lse, mask=head_ok)


def write_latent_cache(
    latent: torch.Tensor,  # [num_tokens, width]
    cache: torch.Tensor,  # [num_blocks, block_size, width]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot = block * block_size + offset
) -> None:
    """Scatter this step's latent rows into the paged cache, one program per token, no host
    sync. A negative slot leaves its token out (padded rows need not own a slot)."""
    num_tokens, width = latent.shape
    if num_tokens == 0:
        return
    if latent.dtype != cache.dtype or cache.shape[-1] != width:
        raise ValueError(
            f"latents {tuple(latent.shape)} {latent.dtype} do not fit the latent cache "
            f"{tuple(cache.shape)} {cache.dtype}"
        )
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    _write_latent_kernel[(num_tokens,)](
        latent, cache, slot_mapping, latent.stride(0), cache.stride(0), cache.stride(1),
        WIDTH=width, BLOCK=triton.next_power_of_2(width), PAGE_SIZE=cache.shape[1],
    )  # fmt: skip


@triton.jit
def _write_latent_kernel(
    latent_ptr, cache_ptr, slot_ptr, stride_lt, stride_cb, stride_cs,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    # WIDTH (576 in the real models) is no power of two: the row is one masked BLOCK.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = (cols < WIDTH) & (slot >= 0)
    row = tl.load(latent_ptr + t * stride_lt + cols, mask=ok)
    dst = cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
    tl.store(dst + cols, row, mask=ok)
