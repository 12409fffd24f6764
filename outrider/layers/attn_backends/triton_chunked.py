r"""Batch-invariant split attention: the deterministic mode's one attention kernel pair for
decode, chain and tree verify and prefill chunks alike.

A row's arithmetic may depend on its position and its keys only, yet one long row must still
spread over many programs. So the keys of every row are cut at FIXED boundaries, multiples of
CHUNK_KEYS counted from key 0 (never a count chosen from the batch, the query length or the
longest context), and:

    stage 1  _chunk_kernel, grid (sequences, kv_heads, q_tiles * programs): a program takes one
             query tile (BLOCK_Q tokens of one sequence x the group's query heads, the layout
             of triton_prefill) and chunks prog, prog + programs, ...; for each chunk it walks
             the chunk's keys in BLOCK_N tiles from the chunk's first key, online softmax from
             scratch, and stores the chunk's partial (running max m, sum l, unnormalised acc;
             fp32, log2 domain) per row.
    stage 2  _merge_chunks_kernel, grid (sequences, kv_heads, q_tiles): folds a row's partials
             in chunk order 0, 1, 2, ... up to its own last chunk, ceil((pos + 1) / CHUNK_KEYS),
             with one formula, then divides once.

Worked example, CHUNK_KEYS 256, BLOCK_N 32: a row at position 600 sees keys 0..600, chunks
[0,256) [256,512) [512,601): two full walks of 8 tiles and one of 3 (its last tile masked past
600). As a decode row its tile ends there; as row 3 of a 5-token verify, or inside a 16-token
prefill tile, the third walk runs on to the tile's last position, and those extra keys and
tiles are masked for it: p = 0 and alpha = 1, exact no-ops. Chunks past 2 hold nothing of it,
and the merge never reads them. So a decode row, a verify row and a prefill row at one
position, alone or batched, chunked prefill or not, produce the same bits: one tile shape, one
set of constexprs, the same two kernels for every step kind.

Tree verifies (a tree mask, AttentionMetadata.tree_mask): a node at depth d sits at rotary
position root + d, but its KV slot is root + 1 + its node index, among siblings it must not
see. Its keys, in the order of the decode row it must equal, are the context, the root and its
ancestors by depth, which are its mask row's set columns in column order (a parent's index is
below its child's). So with `tree=True` each query tile holds one token, and key i of a row is
read from the slot of the row's i-th visible key: the same values at the same places of the
same tiles as the decode row at root + d, once the accepted path's KV sits in path order.
Example, root at 100 (chunk 256, context 0..99 first), nodes [n0 (root's), n1 (root's),
n2 (n1's)]: n2's keys are 0..99, then slots 100 (root), 102 (n1), 103 (n2) read as keys 100,
101, 102, as the decode row at position 102 reads them after n1 and n2 are accepted.

`programs` (per query tile) and the launch cuts only shape the grid: which program computes a
chunk, or in which launch a row sits, changes no arithmetic. Both come from host lengths only
(`plan_chunks`). Under a CUDA graph the host's context length is max_model_len, so the grid and
workspace cover every chunk a replay can meet; programs past a tile's context find no chunk.

Workspace: rows x num_heads x max_chunks x (head_dim + 2) fp32, max_chunks = ceil(longest
context / CHUNK_KEYS). Llama-3.1-8B (32 heads, head_dim 128) at 8K context: 532 KB a query
row, so a decode of 64 rows takes 34 MB and a verify of 64 x 5 rows 170 MB. A step whose rows
need more than WORKSPACE_BYTES (an 8K prefill chunk: 4.4 GB; a 64 x 5 verify at 32K context)
is cut into launches of whole sequences, or of one sequence's query tiles, that fit; one
buffer serves them in turn (rows are independent: cuts change nothing). The partials cost
traffic too: a prefill row at position p writes and reads ceil((p + 1) / 256) of them,
2 * (head_dim + 2) * 4 bytes a head per 256 keys' 4 * 256 * head_dim flops, ~1 byte per 128
flops: near the H200's balance, so long prefill chunks may pay up to about twice the default
kernel's attention time (not yet measured: benchmarks/deterministic.py --attention-only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from outrider.layers.attn_backends.triton_decode import (
    LOG2E,
    check_paged_inputs,
    dot_precision,
    load_paged_tile,
)
from outrider.layers.attn_backends.triton_prefill import (
    check_tree_mask,
    prefill_config,
    query_tile,
)

# Keys per chunk: a constant of the mode. 256 matches the default decode's shortest split
# (MIN_TOKENS_PER_SPLIT): Llama-3.1-8B at C=1 and 8K context runs 8 x 32 = 256 programs on
# 132 SMs; a shorter chunk adds merge traffic and workspace, a longer one idles SMs.
CHUNK_KEYS = 256
# The partials one launch may hold; a step whose rows need more runs several launches.
WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class Launch:
    """One launch of both kernels over sequences [seq0, seq0 + seqs) and their query tiles
    [tile0, tile0 + tiles); its rows are tokens [token0, token0 + rows), workspace rows 0.."""

    seq0: int
    seqs: int
    tile0: int
    tiles: int
    token0: int
    rows: int
    programs: int  # stage-1 programs per query tile


@dataclass(frozen=True)
class ChunkPlan:
    """What only host lengths decide: tile shape, chunks, grid and launch cuts. Built once per
    step (and per attention shape) by plan_chunks."""

    block_q: int
    group_pad: int
    block_n: int
    num_warps: int
    num_stages: int
    chunk_keys: int
    max_chunks: int
    rows: int  # workspace rows: the largest launch's
    launches: tuple[Launch, ...]
    tree: bool = False  # one token a query tile, keys read through the row's tree mask


@dataclass
class ChunkWorkspace:
    """fp32 chunk partials of one launch; allocated once per step, reused by every layer and
    every launch (they run one after another on one stream)."""

    acc: torch.Tensor  # [rows, num_heads, max_chunks, head_dim]: unnormalised output
    m: torch.Tensor  # [rows, num_heads, max_chunks]: running max, log2 domain
    l_sum: torch.Tensor  # [rows, num_heads, max_chunks]

    @classmethod
    def allocate(
        cls, plan: ChunkPlan, num_heads: int, head_dim: int, device: torch.device
    ) -> ChunkWorkspace:
        shape = (plan.rows, num_heads, plan.max_chunks)
        f32 = torch.float32
        return cls(
            torch.empty(*shape, head_dim, dtype=f32, device=device),
            torch.empty(shape, dtype=f32, device=device),
            torch.empty(shape, dtype=f32, device=device),
        )

    def fits(self, plan: ChunkPlan, num_heads: int, head_dim: int) -> bool:
        return tuple(self.acc.shape) == (plan.rows, num_heads, plan.max_chunks, head_dim)


def plan_chunks(
    query_lens: list[int],
    max_seq_len: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_sms: int,
    chunk_keys: int = CHUNK_KEYS,
    max_rows: int | None = None,
    tree: bool = False,
) -> ChunkPlan:
    """Host ints only. query_lens must be the device query_start_loc's gaps exactly (a launch's
    workspace rows are its tokens), max_seq_len must bound every device seq_len (it sizes the
    chunks; a graph passes max_model_len). max_rows caps a launch's rows (tests); None derives
    it from WORKSPACE_BYTES. chunk_keys other than CHUNK_KEYS is for tests only. tree: the
    step has a tree mask (one token a query tile)."""
    block_m, block_n, num_warps, num_stages = prefill_config(head_dim, dtype)
    if chunk_keys < block_n or chunk_keys % block_n:
        raise ValueError(
            f"chunk_keys {chunk_keys} must be a positive multiple of the key tile {block_n}: "
            f"a chunk walks whole tiles from its first key"
        )
    block_q, group_pad = query_tile(None, num_heads // kv_heads, block_m)
    per_tile = 1 if tree else block_q  # tokens a query tile holds
    max_chunks = max(1, -(-max_seq_len // chunk_keys))
    if max_rows is None:
        max_rows = WORKSPACE_BYTES // (num_heads * max_chunks * (head_dim + 2) * 4)
    max_rows = max(max_rows, block_q)  # at least one query tile a launch
    launches: list[Launch] = []
    group: list[int] = []  # sequences of the launch being filled

    def tiles(n: int) -> int:
        return max(1, -(-n // per_tile))

    def add(seq0: int, seqs: int, tile0: int, n_tiles: int, token0: int, rows: int) -> None:
        busy = seqs * kv_heads * n_tiles
        programs = max(1, min(max_chunks, -(-2 * num_sms // busy)))
        launches.append(Launch(seq0, seqs, tile0, n_tiles, token0, rows, programs))

    def flush() -> None:
        if group:
            rows = sum(query_lens[s] for s in group)
            n_tiles = max(tiles(query_lens[s]) for s in group)
            add(group[0], len(group), 0, n_tiles, starts[group[0]], rows)
            group.clear()

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    for s, n in enumerate(query_lens):
        if n > max_rows:  # one long prefill: cut it by query tiles
            flush()
            per = max_rows // per_tile
            for t0 in range(0, tiles(n), per):
                first = t0 * per_tile
                rows = min(n, (t0 + per) * per_tile) - first
                add(s, 1, t0, min(per, tiles(n) - t0), starts[s] + first, rows)
            continue
        if sum(query_lens[g] for g in group) + n > max_rows:
            flush()
        group.append(s)
    flush()
    rows = max((launch.rows for launch in launches), default=0)
    return ChunkPlan(
        block_q, group_pad, block_n, num_warps, num_stages, chunk_keys, max_chunks, max(rows, 1),
        tuple(launches), tree,
    )  # fmt: skip


def chunked_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32
    plan: ChunkPlan,  # from plan_chunks over these query lengths
    scale: float,
    workspace: ChunkWorkspace | None = None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens, M] bool (AttentionMetadata's)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Causal paged attention, or under a tree mask, every row computed with the arithmetic of
    a lone decode row at its position (see the module docstring). No host sync. A row that sees
    no key (a padded sequence with seq_len 0) comes out 0."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads, group = check_paged_inputs(q, k_cache, v_cache, block_tables)
    batch = block_tables.shape[0]
    if query_start_loc.shape[0] != batch + 1 or seq_lens.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: block_tables has {batch} rows, seq_lens {seq_lens.shape[0]}, "
            f"query_start_loc {query_start_loc.shape[0]} (wants batch + 1)"
        )
    if (tree_mask is not None) != plan.tree:
        raise ValueError(
            f"a tree mask {'given' if tree_mask is not None else 'missing'} with a plan made "
            f"for tree={plan.tree}: pass plan_chunks(..., tree=True) exactly when there is one"
        )
    if tree_mask is not None:
        check_tree_mask(tree_mask, num_tokens)
        tree = tree_mask.view(torch.uint8)  # same bytes; Triton loads u8 plainly
        tree = tree if tree.stride(-1) == 1 else tree.contiguous()
        tree_m = tree.shape[1]
    else:
        tree, tree_m = q, 1  # never read: TREE is off
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out
    if workspace is None or not workspace.fits(plan, num_heads, head_dim):
        workspace = ChunkWorkspace.allocate(plan, num_heads, head_dim, q.device)
    ws = workspace
    common = dict(
        GROUP=group, GROUP_PAD=plan.group_pad, BLOCK_Q=plan.block_q, HEAD_DIM=head_dim,
        CHUNK=plan.chunk_keys, TREE=plan.tree, M_PAD=triton.next_power_of_2(tree_m),
    )  # fmt: skip
    for ln in plan.launches:
        _chunk_kernel[(ln.seqs, kv_heads, ln.tiles * ln.programs)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree,
            ws.acc, ws.m, ws.l_sum,
            scale * LOG2E, ln.seq0, ln.tile0, ln.token0, ln.rows, ln.programs, plan.max_chunks,
            tree_m, tree.stride(0),
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            *ws.acc.stride()[:3], *ws.m.stride()[:2],
            PAGE_SIZE=k_cache.shape[1], BLOCK_N=plan.block_n,
            DOT_PRECISION=dot_precision(q.dtype), **common,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )  # fmt: skip
        _merge_chunks_kernel[(ln.seqs, kv_heads, ln.tiles)](
            ws.acc, ws.m, ws.l_sum, seq_lens, query_start_loc, tree, out,
            ln.seq0, ln.tile0, ln.token0, ln.rows, plan.max_chunks, tree_m, tree.stride(0),
            *ws.acc.stride()[:3], *ws.m.stride()[:2], *out.stride()[:2],
            **common, num_warps=plan.num_warps,
        )  # fmt: skip
    return out


@triton.jit
def _tree_columns(tree_ptr, stride_tree, tree_m, token, live, seq_len, M_PAD: tl.constexpr):
    """A tree row's mask row: (rank [M_PAD], each existing visible column's place among them,
    -1 elsewhere; the keys before the mask's columns; the visible columns). Column j is the
    key at seq_len - tree_m + j; one at a negative position does not exist."""
    cols = tl.arange(0, M_PAD)
    base = seq_len - tree_m
    vis = tl.load(tree_ptr + token * stride_tree + cols, mask=live & (cols < tree_m), other=0)
    vis = (vis != 0) & (base + cols >= 0)
    rank = tl.where(vis, tl.cumsum(vis.to(tl.int32), 0) - 1, -1)
    return rank, tl.maximum(base, 0), tl.sum(vis.to(tl.int32), 0)


@triton.jit
def _tile_rows(
    query_start_ptr, seq_lens_ptr, tree_ptr, b, q_tile, token0, rows_in_launch, tree_m,
    stride_tree,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TREE: tl.constexpr,
    M_PAD: tl.constexpr,
):  # fmt: skip
    """The BLOCK_Q * GROUP_PAD rows of query tile q_tile of sequence b (row r = token r //
    GROUP_PAD, head r % GROUP_PAD; with TREE the tile is one token, rows r < GROUP_PAD):
    (token, ws_row, head offset g, row_ok, position, kv_end), kv_end the keys the tile's last
    query sees (0 past the query), a tree row's position the decode row's it equals (keys
    before the mask's columns plus its visible columns, less one). Shared by both stages so
    they agree on every row."""
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    g = r % GROUP_PAD
    if TREE:
        first_q = q_tile
        tok = first_q + r * 0
        _, before, seen = _tree_columns(
            tree_ptr, stride_tree, tree_m, q_start + q_tile, q_tile < q_len, seq_len, M_PAD
        )
        last = before + seen - 1
        pos = last + r * 0
        in_tile = r < GROUP_PAD
        kv_end = tl.where(first_q < q_len, tl.maximum(last + 1, 0), 0)
    else:
        first_q = q_tile * BLOCK_Q
        tok = first_q + r // GROUP_PAD
        pos = seq_len - q_len + tok
        in_tile = r >= 0
        kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(first_q + BLOCK_Q, q_len))
        kv_end = tl.where(first_q < q_len, tl.maximum(kv_end, 0), 0)
    token = q_start + tok
    ws_row = token - token0
    # The workspace bound only guards memory: plan_chunks makes every valid row land inside.
    row_ok = in_tile & (tok < q_len) & (g < GROUP) & (ws_row >= 0) & (ws_row < rows_in_launch)
    return token, ws_row, g, row_ok, pos, kv_end


@triton.jit(do_not_specialize=["seq0", "tile0", "token0", "rows_in_launch", "programs"])
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, tree_ptr,
    acc_ptr, m_ptr, l_ptr,
    qk_scale,  # softmax scale * log2(e)
    seq0, tile0, token0, rows_in_launch, programs, max_chunks, tree_m, stride_tree,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ar, stride_ah, stride_ac,
    stride_mr, stride_mh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TREE: tl.constexpr,
    M_PAD: tl.constexpr,
):  # fmt: skip
    b = seq0 + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tile0 + tl.program_id(2) // programs
    prog = tl.program_id(2) % programs
    token, ws_row, g, row_ok, pos, kv_end = _tile_rows(
        query_start_ptr, seq_lens_ptr, tree_ptr, b, q_tile, token0, rows_in_launch, tree_m,
        stride_tree, GROUP, GROUP_PAD, BLOCK_Q, TREE, M_PAD,
    )  # fmt: skip
    if TREE:  # the row's visible columns, in order: where its keys past `before` are read
        q_start = tl.load(query_start_ptr + b)
        live = q_tile < tl.load(query_start_ptr + b + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + b)
        rank, before, _ = _tree_columns(
            tree_ptr, stride_tree, tree_m, q_start + q_tile, live, seq_len, M_PAD
        )
        base = seq_len - tree_m
        cols = tl.arange(0, M_PAD)
    head = kv_head * GROUP + g
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]
    ws = ws_row.to(tl.int64)
    acc_dst = acc_ptr + ws[:, None] * stride_ar + head[:, None] * stride_ah + dims[None, :]
    m_dst = m_ptr + ws * stride_mr + head * stride_mh
    l_dst = l_ptr + ws * stride_mr + head * stride_mh
    table = block_tables_ptr + b * stride_bt
    n_chunks = tl.minimum(tl.cdiv(kv_end, CHUNK), max_chunks)
    for c in range(prog, n_chunks, programs):
        # Each chunk starts from scratch: its partial depends on its own keys alone.
        start = c * CHUNK
        end = tl.minimum(start + CHUNK, kv_end)
        m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            key_ok = keys < end
            at = keys  # where key i is stored
            if TREE:  # key before + i is the row's visible column of rank i
                hit = rank[None, :] == (keys - before)[:, None]  # [BLOCK_N, M_PAD]
                col = tl.sum(tl.where(hit, cols[None, :], 0), 1)
                at = tl.where(keys >= before, base + col, keys)
            page = tl.load(table + at // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            slot = at % PAGE_SIZE
            k = load_paged_tile(
                k_ptr, kv_head, page, slot, dims, key_ok, stride_kh, stride_kb, stride_ks
            )  # [BLOCK_N, HEAD_DIM]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            # Keys past a row's position (a later row's, in a verify or prefill tile) leave it
            # exactly as a decode row's shorter walk does: p = 0, alpha = 2^0 = 1.
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
        tl.store(acc_dst + c * stride_ac, acc, mask=row_ok[:, None])
        tl.store(m_dst + c, m, mask=row_ok)
        tl.store(l_dst + c, l_sum, mask=row_ok)


@triton.jit(do_not_specialize=["seq0", "tile0", "token0", "rows_in_launch"])
def _merge_chunks_kernel(
    acc_ptr, m_ptr, l_ptr, seq_lens_ptr, query_start_ptr, tree_ptr, out_ptr,
    seq0, tile0, token0, rows_in_launch, max_chunks, tree_m, stride_tree,
    stride_ar, stride_ah, stride_ac,
    stride_mr, stride_mh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, TREE: tl.constexpr, M_PAD: tl.constexpr,
):  # fmt: skip
    b = seq0 + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tile0 + tl.program_id(2)
    token, ws_row, g, row_ok, pos, kv_end = _tile_rows(
        query_start_ptr, seq_lens_ptr, tree_ptr, b, q_tile, token0, rows_in_launch, tree_m,
        stride_tree, GROUP, GROUP_PAD, BLOCK_Q, TREE, M_PAD,
    )  # fmt: skip
    head = kv_head * GROUP + g
    dims = tl.arange(0, HEAD_DIM)
    # A row's own chunks: those holding a key <= pos. Every one holds at least one (its first).
    own = tl.where(row_ok, tl.minimum(tl.cdiv(pos + 1, CHUNK), max_chunks), 0)
    ws = ws_row.to(tl.int64)
    acc_src = acc_ptr + ws[:, None] * stride_ar + head[:, None] * stride_ah + dims[None, :]
    m_src = m_ptr + ws * stride_mr + head * stride_mh
    l_src = l_ptr + ws * stride_mr + head * stride_mh
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    for c in range(0, tl.max(own, 0)):
        # In chunk order, one row at a time in effect: every op below is elementwise per row,
        # and a row past its own chunks keeps its state bit for bit (tl.where, not a no-op sum).
        live = c < own
        m_c = tl.load(m_src + c, mask=live, other=float("-inf"))
        l_c = tl.load(l_src + c, mask=live, other=0.0)
        a_c = tl.load(acc_src + c * stride_ac, mask=live[:, None], other=0.0)
        m_new = tl.maximum(m, m_c)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        beta = tl.exp2(m_c - m_safe)
        l_sum = tl.where(live, l_sum * alpha + l_c * beta, l_sum)
        acc = tl.where(live[:, None], acc * alpha[:, None] + a_c * beta[:, None], acc)
        m = tl.where(live, m_new, m)
    l_safe = tl.where(l_sum > 0.0, l_sum, 1.0)
    out = acc / l_safe[:, None]
    dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
