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


@triton.jit
def accept_tree_kernel(
    argmax_ptr, drafts_ptr, parents_ptr, anc_ptr, depth_ptr, num_nodes_ptr, starts_ptr,
    tables_ptr, path_ptr, num_acc_ptr, tokens_ptr, src_ptr, dst_ptr,
    n, table_width, block_size,
    D: tl.constexpr, R_PAD: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    # One program per batch row; verify rows r = 0 (the root) .. n (node r - 1). What
    # speculative/tree_batch.py's accept_tree_greedy_no_sync and tree_kv_moves_no_sync compute
    # in ~40 small kernels, with each path position's KV slot looked up in the block table.
    b = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R_PAD)
    node = r - 1
    in_tree = r <= n
    real = (r >= 1) & in_tree & (node < tl.load(num_nodes_ptr + b))
    tok = tl.load(drafts_ptr + b * n + node, mask=real, other=-1)
    par = tl.load(parents_ptr + b * n + node, mask=real, other=-1)
    said = tl.load(argmax_ptr + b * (n + 1) + par + 1, mask=real, other=-2)
    ok = (r == 0) | (real & (tok == said))  # the node's token is the argmax at its parent
    dep = tl.load(depth_ptr + b * n + node, mask=(r >= 1) & in_tree, other=0)
    dep = tl.where(r == 0, 0, dep)
    anc_row = anc_ptr + b * (n + 1) * (n + 1)
    q = r[:, None]
    j = r[None, :]
    both = (q <= n) & (j <= n)
    anc = tl.load(anc_row + q * (n + 1) + j, mask=both, other=0) != 0
    bad = tl.sum((anc & (ok[None, :] == 0)).to(tl.int32), axis=1)  # an ancestor unmatched
    score = tl.where((bad == 0) & in_tree, dep, -1)
    best = tl.argmax(score, axis=0)  # the deepest accepted node (the root: depth 0)
    num_acc = tl.max(score, axis=0)
    on_path = tl.load(anc_row + best * (n + 1) + r, mask=in_tree, other=0) != 0
    lv = tl.arange(0, D_PAD)
    hit = (on_path[None, :] & (dep[None, :] == lv[:, None]) & in_tree[None, :]).to(tl.int32)
    rows = tl.argmax(hit, axis=1)  # the path's row at each depth (0 where none)
    rows = tl.where(lv <= num_acc, rows, best).to(tl.int64)
    live = lv <= D
    tl.store(path_ptr + b * (D + 1) + lv, rows, mask=live)
    tl.store(num_acc_ptr + b, num_acc.to(tl.int64))
    tl.store(
        tokens_ptr + b * (D + 1) + lv,
        tl.load(argmax_ptr + b * (n + 1) + rows, mask=live),
        mask=live,
    )
    # KV: the node at depth l (1..D) moves from root + its row to root + l; past the accepted
    # depth it stays (src == dst).
    start = tl.load(starts_ptr + b)
    move = live & (lv >= 1)
    dst_pos = start + lv
    src_pos = tl.where(lv <= num_acc, start + rows, dst_pos)
    tables = tables_ptr + b * table_width
    dcol = tl.minimum(dst_pos // block_size, table_width - 1)
    scol = tl.minimum(src_pos // block_size, table_width - 1)
    dst = (
        tl.load(tables + dcol, mask=move, other=0).to(tl.int64) * block_size + dst_pos % block_size
    )
    src = (
        tl.load(tables + scol, mask=move, other=0).to(tl.int64) * block_size + src_pos % block_size
    )
    tl.store(dst_ptr + b * D + lv - 1, dst, mask=move)
    tl.store(src_ptr + b * D + lv - 1, src, mask=move)


@triton.jit
def grow_select_kernel(
    scores_ptr, logp_ptr, child_ptr, d2t_ptr, summed_ptr, anc_ptr,
    out_scores_ptr, out_parent_ptr, out_tokens_ptr, out_hidden_ptr, out_anc_ptr,
    m_cols, stride_summed,
    T: tl.constexpr, T_PAD: tl.constexpr, M_PAD: tl.constexpr, HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    # One program per batch row: of the T x T children (parent i's candidate c scores
    # scores[i] + logp[i, c]) keep the best T, ties to the lower (i, c); each kept child's
    # target id, its parent's hidden row and ancestor row, plus its own column.
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, T_PAD)[:, None]
    c = tl.arange(0, T_PAD)[None, :]
    ok = (i < T) & (c < T)
    parent_score = tl.load(scores_ptr + b * T + i, mask=i < T, other=0.0)
    logp = tl.load(logp_ptr + (b * T + i) * T + c, mask=ok, other=0.0)
    cum = tl.where(ok, parent_score + logp, float("-inf"))
    flat_ix = tl.reshape(i * T_PAD + c, [T_PAD * T_PAD])
    cum = tl.reshape(cum, [T_PAD * T_PAD])
    cols = tl.arange(0, M_PAD)
    for s in tl.static_range(T):
        best = tl.max(cum, axis=0)
        pick = tl.min(tl.where(cum == best, flat_ix, T_PAD * T_PAD), axis=0)
        cum = tl.where(flat_ix == pick, float("-inf"), cum)
        parent = pick // T_PAD
        child = tl.load(child_ptr + (b * T + parent) * T + pick % T_PAD)
        tl.store(out_scores_ptr + b * T + s, best)
        tl.store(out_parent_ptr + b * T + s, parent.to(tl.int64))
        tl.store(out_tokens_ptr + b * T + s, child + tl.load(d2t_ptr + child))
        src = summed_ptr + (b * T + parent) * stride_summed
        dst = out_hidden_ptr + (b * T + s) * HIDDEN
        for h0 in tl.static_range(0, HIDDEN, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            tl.store(dst + h, tl.load(src + h, mask=h < HIDDEN), mask=h < HIDDEN)
        row = tl.load(anc_ptr + (b * T + parent) * m_cols + cols, mask=cols < m_cols, other=0)
        out_row = out_anc_ptr + (b * T + s) * (m_cols + T)
        tl.store(out_row + cols, row, mask=cols < m_cols)
        own = tl.arange(0, T_PAD)
        tl.store(out_row + m_cols + own, (own == s).to(tl.uint8), mask=own < T)


@triton.jit
def mla_prep_kernel(
    q_ptr, kv_ptr, latent_ptr, w_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kv, stride_lat, stride_cos, stride_cb, stride_cs, eps,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NOPE: tl.constexpr, RANK: tl.constexpr,
    RANK_PAD: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    # One program per token. kv row: [c_kv (RANK) | k_pe (2 HALF)]; q row: HEADS heads of
    # [nope (NOPE) | pe (2 HALF)]. Writes latent = [rmsnorm(c_kv) * w | rope(k_pe)] and ropes
    # every head's pe in place. INTERLEAVED: pe pairs are (2i, 2i + 1) and come out as
    # rotate-half on [evens | odds], the order the cached keys keep. CACHE: the latent row goes
    # to the paged cache's slot too (none where the slot is negative), as _write_latent_kernel
    # would store it.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + dims)
    sin = tl.load(sin_ptr + pos * stride_cos + dims)
    if INTERLEAVED:
        first, second = 2 * dims, 2 * dims + 1
    else:
        first, second = dims, dims + HALF
    # 1. The latent: the norm rounds as rms_norm_kernel, the rotary as rotary_kernel.
    cols = tl.arange(0, RANK_PAD)
    ok = cols < RANK
    c = tl.load(kv_ptr + t * stride_kv + cols, mask=ok, other=0.0)
    h = c.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / RANK + eps)
    normed = (h * inv).to(c.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = latent_ptr + t * stride_lat
    c_out = (normed.to(tl.float32) * w.to(tl.float32)).to(c.dtype)
    tl.store(out + cols, c_out, mask=ok)
    k1 = tl.load(kv_ptr + t * stride_kv + RANK + first).to(tl.float32)
    k2 = tl.load(kv_ptr + t * stride_kv + RANK + second).to(tl.float32)
    pe1, pe2 = (k1 * cos - k2 * sin).to(c.dtype), (k2 * cos + k1 * sin).to(c.dtype)
    tl.store(out + RANK + dims, pe1)
    tl.store(out + RANK + HALF + dims, pe2)
    if CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        page = tl.maximum(slot, 0)
        row = cache_ptr + (page // PAGE_SIZE) * stride_cb + (page % PAGE_SIZE) * stride_cs
        keep = slot >= 0
        tl.store(row + cols, c_out, mask=ok & keep)
        tl.store(row + RANK + dims, pe1, mask=(dims < HALF) & keep)
        tl.store(row + RANK + HALF + dims, pe2, mask=(dims < HALF) & keep)
    # 2. Every head's query pe, in place: all of a head's pairs are read before any is written.
    heads = tl.arange(0, HEADS_PAD)[:, None]
    hok = heads < HEADS
    base = q_ptr + t * stride_qt + heads * stride_qh + NOPE
    x1 = tl.load(base + first[None, :], mask=hok, other=0.0)
    x2 = tl.load(base + second[None, :], mask=hok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.debug_barrier()
    tl.store(base + dims[None, :], (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=hok)
    tl.store(base + HALF + dims[None, :], (b * cos[None, :] + a * sin[None, :]).to(x1.dtype),
             mask=hok)  # fmt: skip


@triton.jit
def token_bitmask_kernel(
    logits_ptr, mask_ptr, stride_l, stride_m, vocab, words, BLOCK: tl.constexpr
):  # fmt: skip
    # Program (row, block): tokens [block * BLOCK, +BLOCK) of a row become -inf where bit
    # t % 32 of the row's word t // 32 is 0; tokens past 32 words are refused.
    row = tl.program_id(0).to(tl.int64)
    toks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = toks < vocab
    word = toks // 32
    bits = tl.load(mask_ptr + row * stride_m + word, mask=ok & (word < words), other=0)
    allowed = ((bits >> (toks % 32)) & 1) != 0
    dst = logits_ptr + row * stride_l + toks
    tl.store(dst, tl.full((BLOCK,), float("-inf"), tl.float32), mask=ok & ~allowed)


@triton.jit
def masked_argmax_kernel(
    logits_ptr, rows_ptr, mask_ptr, out_ptr, stride_l, stride_m, words, VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Program r: the argmax of logits row rows[r] among the tokens bit t % 32 of mask row r's
    # word t // 32 allows (tokens past 32 words refused). Ties go to the lowest token, as
    # torch.argmax breaks them; a row that allows nothing gives 0, as argmax over -inf does.
    # VOCAB is a constexpr (one compilation per model; a runtime loop bound also trips the
    # CPU interpreter under numpy 2).
    r = tl.program_id(0)
    src = tl.load(rows_ptr + r).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    # Per lane the largest allowed logit seen and its first token (strictly larger replaces).
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, VOCAB, BLOCK):
        toks = start + lanes
        ok = toks < VOCAB
        word = toks // 32
        bits = tl.load(mask_ptr + r.to(tl.int64) * stride_m + word, mask=ok & (word < words),
                       other=0)  # fmt: skip
        allowed = ok & (((bits >> (toks % 32)) & 1) != 0)
        x = tl.load(logits_ptr + src * stride_l + toks, mask=allowed, other=float("-inf"))
        x = tl.where(allowed, x.to(tl.float32), float("-inf"))
        better = x > best_val
        best_idx = tl.where(better, toks, best_idx)
        best_val = tl.where(better, x, best_val)
    top = tl.max(best_val, 0)
    best = tl.min(tl.where(best_val == top, best_idx, VOCAB), 0)
    tl.store(out_ptr + r, best.to(tl.int64))


_NO_TOKEN = tl.constexpr(2**30)  # past any vocabulary: "nothing left" in the top-k kernels


@triton.jit
def topk_chunk_kernel(
    x_ptr, val_ptr, idx_ptr, stride_x, VOCAB: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program (r, c): the K highest of row r's tokens [c BLOCK, (c + 1) BLOCK), best first, ties
    # to the lowest token, as fp32 values and token ids at [r, c K + j]. A chunk of fewer than K
    # tokens ends with -inf at _NO_TOKEN.
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    toks = c * BLOCK + tl.arange(0, BLOCK)
    taken = toks >= VOCAB
    x = tl.load(x_ptr + r * stride_x + toks, mask=toks < VOCAB, other=float("-inf"))
    x = x.to(tl.float32)
    at = (r * tl.num_programs(1) + c) * K
    for j in tl.static_range(K):
        left = tl.where(taken, float("-inf"), x)
        best = tl.max(left, 0)
        tok = tl.min(tl.where((toks < VOCAB) & (taken == 0) & (left == best), toks, _NO_TOKEN), 0)
        tl.store(val_ptr + at + j, best)
        tl.store(idx_ptr + at + j, tok)
        taken = taken | (toks == tok)


@triton.jit
def topk_merge_kernel(
    val_ptr, idx_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Program r: the K best of row r's N chunk candidates (value, then the lowest token), into
    # out row r [2 K] float64: the K token ids, then their values.
    r = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    ok = lanes < N
    val = tl.load(val_ptr + r * N + lanes, mask=ok, other=float("-inf"))
    tok = tl.load(idx_ptr + r * N + lanes, mask=ok, other=_NO_TOKEN)
    taken = lanes >= N
    for j in tl.static_range(K):
        left = tl.where(taken, float("-inf"), val)
        best = tl.max(left, 0)
        pick = tl.min(tl.where((taken == 0) & (left == best), tok, _NO_TOKEN + 1), 0)
        tl.store(out_ptr + r * 2 * K + j, pick.to(tl.float64))
        tl.store(out_ptr + r * 2 * K + K + j, best.to(tl.float64))
        taken = taken | (tok == pick)


@triton.jit
def ngram_drafts_kernel(
    window_ptr, valid_ptr, out_ptr, width,
    K: tl.constexpr, K_PAD: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # Program b: row b's k drafts as speculative/ngram_device.py's ngram_drafts_no_sync makes
    # them in ~30 launches. Lanes are the candidate ends e = 0 .. width - 2 of an earlier
    # occurrence; the suffix ends at last = width - 1.
    b = tl.program_id(0).to(tl.int64)
    row = window_ptr + b * width
    vrow = valid_ptr + b * width
    last = width - 1
    e = tl.arange(0, BLOCK)
    run = e < last
    match = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(MAX_N):
        at = e - i
        ok = run & (at >= 0)
        tok = tl.load(row + at, mask=ok, other=-1)
        seen = tl.load(vrow + at, mask=ok, other=0) != 0
        back = tl.maximum(last - i, 0)
        suffix = tl.load(row + back)
        live = (tl.load(vrow + back) != 0) & (last - i >= 0)
        run = ok & seen & live & (tok == suffix)
        match += run.to(tl.int32)
    score = tl.where(match >= MIN_N, match * BLOCK + e, -1)
    best = tl.max(score, axis=0)
    end = tl.argmax(score, axis=0)
    period = tl.maximum(last - end, 1)
    j = tl.arange(0, K_PAD)
    idx = tl.minimum(end + 1 + j % period, last)
    drafts = tl.load(row + idx, mask=j < K, other=0)
    newest = tl.load(row + last)
    drafts = tl.where(best >= 0, drafts, newest)
    tl.store(out_ptr + b * K + j, drafts, mask=j < K)
