"""Fused elementwise kernels for CUDA: RMSNorm with the residual add, rotary on q and k in place,
SiLU-and-mul. Each replaces several small PyTorch kernels (casts, pow, mean, rsqrt, muls, adds)
with one launch, which is what a batch-1 decode step is made of once the GEMMs are near the
bandwidth limit.

Every kernel rounds where the PyTorch path rounds (the residual sum to the model dtype, the
normalized row to the model dtype before the weight multiply, silu(gate) before the multiply by
up), so fused and unfused forwards agree to the last bit except for the order of the fp32 sum
inside the norm. The layers call `use_fused(x)`; it is true on CUDA with triton importable and
`OUTRIDER_FUSED_KERNELS` not 0. The CPU suite checks the kernels under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools

import torch

from outrider import env


@functools.lru_cache(maxsize=1)
def triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused(x: torch.Tensor) -> bool:
    """True when the fused kernels serve this tensor: CUDA, triton importable, not disabled by
    OUTRIDER_FUSED_KERNELS=0, and autograd off (the kernels have no backward: training a
    drafter runs the PyTorch ops; serving and feature capture run under inference mode)."""
    return x.is_cuda and not torch.is_grad_enabled() and env.fused_kernels() and triton_ok()


def rms_norm(
    x: torch.Tensor,  # [T, N], rows contiguous
    weight: torch.Tensor,  # [N], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * norm(x) or, with residual, (weight * norm(x + residual), x + residual)."""
    k = _kernels()
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        res = residual if residual is not None else x
        k.rms_norm_kernel[(rows,)](
            x, res, out, res_out, weight, x.stride(0), res.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=k.next_pow2(n),
        )  # fmt: skip
    return out if residual is None else (out, res_out)


def rotary_(
    qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]; q and k heads rotated in place
    positions: torch.Tensor,  # [T] int
    cos: torch.Tensor,  # [max_positions, head_dim / 2] float32
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Rotate-half rotary on the q and k heads of a packed qkv row, in place."""
    k = _kernels()
    tokens = qkv.shape[0]
    if tokens:
        k.rotary_kernel[(tokens,)](
            qkv, positions, cos, sin, qkv.stride(0), cos.stride(0),
            HEADS=num_heads + num_kv_heads, HEADS_PAD=k.next_pow2(num_heads + num_kv_heads),
            HALF=head_dim // 2,
        )  # fmt: skip


def mla_prep_(
    q: torch.Tensor,  # [T, heads, nope + 2 * half]: each head's pe roped in place
    kv: torch.Tensor,  # [T, rank + 2 * half]: kv_a_proj_with_mqa's output, rows contiguous
    norm_weight: torch.Tensor,  # [rank] kv_a_layernorm's
    eps: float,
    positions: torch.Tensor,  # [T] int
    cos: torch.Tensor,  # [max_positions, half] float32
    sin: torch.Tensor,
    interleaved: bool,
    sink: tuple[torch.Tensor, torch.Tensor] | None = None,  # (cache, slot_mapping)
) -> torch.Tensor:  # [T, rank + 2 * half] the latent to cache: [rmsnorm(c_kv) | rope(k_pe)]
    """An MLA layer's glue between its projections and attention in one launch: the latent's
    norm, the shared key's rotary and every head's query rotary (with interleaved pairs
    deinterleaved as they are rotated), as rms_norm and rotary_ round them. `sink`: the paged
    latent cache [num_blocks, block_size, rank + 2 * half] and this step's slots [T] int64
    (negative: none), where the same launch stores each token's latent as
    write_latent_cache would."""
    k = _kernels()
    tokens, heads, width = q.shape
    half = cos.shape[-1]
    rank = kv.shape[-1] - 2 * half
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or width <= 2 * half:
        raise ValueError(
            f"mla_prep_: q {tuple(q.shape)} and kv {tuple(kv.shape)} need contiguous rows and "
            f"a nope part before the {2 * half} rotary dims"
        )
    latent = torch.empty(tokens, rank + 2 * half, dtype=kv.dtype, device=kv.device)
    # With no sink the cache arguments are any tensors of the right kind (CACHE is off).
    cache, slots = sink if sink is not None else (latent.unsqueeze(0), positions)
    if cache.dim() != 3 or cache.shape[-1] != latent.shape[-1] or cache.dtype != latent.dtype:
        raise ValueError(
            f"mla_prep_: latents [{tokens}, {latent.shape[-1]}] {latent.dtype} do not fit the "
            f"latent cache {tuple(cache.shape)} {cache.dtype}"
        )
    if tokens:
        k.mla_prep_kernel[(tokens,)](
            q, kv, latent, norm_weight, positions, cos, sin, cache, slots,
            q.stride(0), q.stride(1), kv.stride(0), latent.stride(0), cos.stride(0),
            cache.stride(0), cache.stride(1), eps,
            HEADS=heads, HEADS_PAD=k.next_pow2(heads), NOPE=width - 2 * half, RANK=rank,
            RANK_PAD=k.next_pow2(rank), HALF=half, INTERLEAVED=interleaved,
            CACHE=sink is not None, PAGE_SIZE=cache.shape[1] if sink is not None else 1,
            num_warps=4,
        )  # fmt: skip
    return latent


def token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """logits [R, V] (rows contiguous) -> -inf wherever bitmask [R, W] int32 on the same
    device has a 0 bit (bit t % 32 of word t // 32 for token t; tokens past 32 W refused), in
    place and in one launch; False (nothing done) where the fused path does not serve."""
    if not use_fused(logits) or logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        return False
    rows, vocab = logits.shape
    if rows:
        block = 1024
        _kernels().token_bitmask_kernel[(rows, -(-vocab // block))](
            logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1],
            BLOCK=block,
        )  # fmt: skip
    return True


def masked_argmax(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor | None:
    """[R] int64: for each r, the argmax of logits[rows[r]] ([N, V], rows contiguous) among the
    tokens bitmask[r] ([R, W] int32, same device) allows, ties to the lowest token, in one
    launch and without copying the rows out; None where the fused path does not serve."""
    if not use_fused(logits) or logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        return None
    count, vocab = rows.numel(), logits.shape[1]
    out = torch.empty(count, dtype=torch.int64, device=logits.device)
    if count:
        _kernels().masked_argmax_kernel[(count,)](
            logits, rows, bitmask, out, logits.stride(0), bitmask.stride(0), bitmask.shape[1],
            VOCAB=vocab, BLOCK=min(4096, _kernels().next_pow2(vocab)),
        )  # fmt: skip
    return out


TOPK_CHUNK = 2048  # tokens a program of top_candidates' first launch ranks


def top_candidates(logits: torch.Tensor, k: int) -> torch.Tensor | None:
    """[R, 2 k] float64: each row of logits [R, V]'s k highest token ids, then their logits as
    float32 holds them, best first and ties to the lowest token (sampler.top_candidates_no_sync's
    layout), in two launches: each chunk of TOPK_CHUNK tokens ranks its k best, then each row
    merges its chunks'. torch.topk takes 70-160 us of host time a call on an H100, more than
    the step's other launches together; this takes two launches'. None where the fused path
    does not serve (or k exceeds a chunk)."""
    if not use_fused(logits) or logits.stride(-1) != 1 or not 0 < k <= TOPK_CHUNK:
        return None
    rows, vocab = logits.shape
    chunks = -(-vocab // TOPK_CHUNK)
    out = torch.empty((rows, 2 * k), dtype=torch.float64, device=logits.device)
    if rows:
        kern = _kernels()
        vals = torch.empty((rows, chunks * k), dtype=torch.float32, device=logits.device)
        toks = torch.empty((rows, chunks * k), dtype=torch.int32, device=logits.device)
        kern.topk_chunk_kernel[(rows, chunks)](
            logits, vals, toks, logits.stride(0), VOCAB=vocab, K=k, BLOCK=TOPK_CHUNK
        )
        kern.topk_merge_kernel[(rows,)](
            vals, toks, out, N=chunks * k, K=k, BLOCK=kern.next_pow2(chunks * k)
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] packed gate|up -> silu(gate) * up: [T, I]."""
    k = _kernels()
    tokens, width = x.shape
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens:
        block = min(1024, k.next_pow2(inter))
        grid = (tokens, -(-inter // block))
        k.silu_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out


MOVE_MAX_SLOTS = 1024  # moves one launch of move_slots_ takes (a tree step: B x depth)


def move_slots_(
    pool: torch.Tensor,  # [L, S, E] contiguous: every layer's S slots of E values
    src: torch.Tensor,  # [M] int64 slots
    dst: torch.Tensor,  # [M] int64 slots
) -> bool:
    """pool[:, dst] = pool[:, src] in one launch, every source read before any destination is
    written; False (nothing done) where the fused path does not serve: the caller's torch ops
    then do it. torch's index_select / index_copy_ over a pool past 2^31 values split into one
    kernel per 32-bit-indexable piece (16 launches a tree step on the H200)."""
    moves = src.numel()
    if not use_fused(pool) or not pool.is_contiguous() or not 0 < moves <= MOVE_MAX_SLOTS:
        return False
    k = _kernels()
    layers, _, width = pool.shape
    m_pad = k.next_pow2(moves)
    block_e = max(16, min(k.next_pow2(width), 8192 // m_pad))
    grid = (layers, -(-width // block_e))
    k.move_slots_kernel[grid](
        pool, src, dst, moves, pool.stride(0), width, M_PAD=m_pad, BLOCK_E=block_e,
        num_warps=8 if m_pad * block_e > 4096 else 4,
    )  # fmt: skip
    return True


def accept_tree(
    argmax: torch.Tensor,  # [B, 1 + N] int64 the target's argmax at each verify row
    drafts: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64, -1 = the root
    anc: torch.Tensor,  # [B, 1 + N, 1 + N] bool
    depth: torch.Tensor,  # [B, N] int64
    num_nodes: torch.Tensor,  # [B] int64
    starts: torch.Tensor,  # [B] int64 root positions
    tables: torch.Tensor,  # [B, W] int32 block tables
    block_size: int,
    max_depth: int,
) -> tuple[torch.Tensor, ...] | None:
    """Greedy tree acceptance and the accepted path's KV moves in one launch -> (path_rows
    [B, 1 + D], num_accepted [B], tokens [B, 1 + D], src slots [B, D], dst slots [B, D]), as
    tree_batch.accept_tree_greedy_no_sync, argmax.gather(1, path_rows), tree_kv_moves_no_sync and
    the table lookup give them; None where the fused path does not serve (the caller runs
    those)."""
    b, n = drafts.shape
    if not use_fused(argmax) or b == 0 or n + 1 > 256:
        return None
    k = _kernels()
    dev = argmax.device
    d = max_depth
    path = torch.empty(b, d + 1, dtype=torch.int64, device=dev)
    num_acc = torch.empty(b, dtype=torch.int64, device=dev)
    tokens = torch.empty(b, d + 1, dtype=torch.int64, device=dev)
    src = torch.empty(b, d, dtype=torch.int64, device=dev)
    dst = torch.empty(b, d, dtype=torch.int64, device=dev)
    k.accept_tree_kernel[(b,)](
        argmax.contiguous(), drafts.contiguous(), parents.contiguous(),
        anc.contiguous().view(torch.uint8), depth.contiguous(), num_nodes.contiguous(),
        starts.contiguous(), tables.contiguous(), path, num_acc, tokens, src, dst,
        n, tables.shape[1], block_size,
        D=d, R_PAD=k.next_pow2(n + 1), D_PAD=k.next_pow2(d + 1), num_warps=4,
    )  # fmt: skip
    return path, num_acc, tokens, src, dst


def grow_select(
    scores: torch.Tensor,  # [B, t] float32 cumulative log-probabilities of the frontier
    child_logp: torch.Tensor,  # [B * t, t] float32 each frontier node's best children
    child: torch.Tensor,  # [B * t, t] int64 their draft ids
    d2t: torch.Tensor,  # [draft_vocab] int64 draft id -> target id offset
    summed: torch.Tensor,  # [B * t, H] the frontier's hidden rows
    anc: torch.Tensor,  # [B, t, M] bool the frontier's ancestor rows
) -> tuple[torch.Tensor, ...] | None:
    """One step of growing draft trees in one launch -> (scores [B, t], parent [B, t], target
    ids [B, t], hidden [B, t, H], anc [B, t, M + t]): the best t of the t x t children, ties to
    the lower (parent, child), with their parents' hidden and ancestor rows and their own new
    column, what the torch ops in executor/drafter.py's tree loop give. None where the fused
    path does not serve."""
    b, t = scores.shape
    if not use_fused(scores) or b == 0 or t > 16 or summed.stride(-1) != 1:
        return None
    k = _kernels()
    dev = scores.device
    m = anc.shape[-1]
    h = summed.shape[-1]
    out_scores = torch.empty(b, t, dtype=torch.float32, device=dev)
    parent = torch.empty(b, t, dtype=torch.int64, device=dev)
    tokens = torch.empty(b, t, dtype=torch.int64, device=dev)
    hidden = torch.empty(b, t, h, dtype=summed.dtype, device=dev)
    out_anc = torch.empty(b, t, m + t, dtype=torch.bool, device=dev)
    k.grow_select_kernel[(b,)](
        scores.contiguous(), child_logp.contiguous(), child.contiguous(), d2t, summed,
        anc.contiguous().view(torch.uint8), out_scores, parent, tokens, hidden,
        out_anc.view(torch.uint8), m, summed.stride(0),
        T=t, T_PAD=k.next_pow2(t), M_PAD=k.next_pow2(max(m, 1)), HIDDEN=h,
        BLOCK_H=min(1024, k.next_pow2(h)), num_warps=4,
    )  # fmt: skip
    return out_scores, parent, tokens, hidden, out_anc


TOP_CHUNK = 4096  # vocabulary entries one program of top_logprobs reads


def top_logprobs(logits: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] -> (log_softmax values [R, t] float32, ids [R, t] int64) of each row's t
    largest logits, descending, ties to the lower id: what `log_softmax(x.float()).topk(t)`
    gives up to rounding, with the tie order defined. A draft tree takes its candidates from
    it at every depth; torch's radix top-k spent ~0.2 ms of a 0.9 ms tree draft at C=1 on the
    H200, this is two launches. The fused path needs use_fused(logits); else the reference."""
    rows, vocab = logits.shape
    if not 1 <= t <= min(vocab, 16):
        raise ValueError(f"top_logprobs: t={t} must be in 1..{min(vocab, 16)} (vocab {vocab})")
    if not use_fused(logits) or rows == 0:
        return top_logprobs_reference(logits, t)
    k = _kernels()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    parts = -(-vocab // TOP_CHUNK)
    chunk = min(TOP_CHUNK, k.next_pow2(vocab))
    dev = logits.device
    cand_v = torch.empty(rows, parts, t, dtype=torch.float32, device=dev)
    cand_i = torch.empty(rows, parts, t, dtype=torch.int32, device=dev)
    part_max = torch.empty(rows, parts, dtype=torch.float32, device=dev)
    part_sum = torch.empty(rows, parts, dtype=torch.float32, device=dev)
    k.top_logprobs_partial_kernel[(rows, parts)](
        logits, logits.stride(0), vocab, chunk, cand_v, cand_i, part_max, part_sum,
        T=t, BLOCK=chunk, num_warps=4,
    )  # fmt: skip
    out_v = torch.empty(rows, t, dtype=torch.float32, device=dev)
    out_i = torch.empty(rows, t, dtype=torch.int64, device=dev)
    k.top_logprobs_merge_kernel[(rows,)](
        cand_v, cand_i, part_max, part_sum, out_v, out_i, parts, vocab,
        T=t, BLOCK_P=k.next_pow2(parts), BLOCK_C=k.next_pow2(parts * t), num_warps=1,
    )  # fmt: skip
    return out_v, out_i


def top_logprobs_reference(logits: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_logprobs in PyTorch ops: t argmaxes (the first of equal values), each masked out
    before the next."""
    x = logits.float().clone()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    values, ids = [], []
    for _ in range(t):
        i = x.argmax(dim=-1, keepdim=True)
        values.append(x.gather(-1, i))
        ids.append(i)
        x.scatter_(-1, i, float("-inf"))
    return torch.cat(values, -1) - lse, torch.cat(ids, -1)


NGRAM_MAX_WINDOW = 1 << 14  # candidates one program of ngram_drafts holds


def ngram_drafts(
    window: torch.Tensor,  # [B, W + 1] int64, rows contiguous
    valid: torch.Tensor,  # [B, W + 1] bool
    min_n: int,
    max_n: int,
    k: int,
) -> torch.Tensor | None:
    """[B, k] int64: speculative/ngram_device.ngram_drafts_no_sync's drafts in one launch; None
    where the fused path does not serve (the caller's torch ops then do it)."""
    b, width = window.shape
    if not use_fused(window) or not 2 <= width <= NGRAM_MAX_WINDOW + 1 or k < 1:
        return None
    kern = _kernels()
    out = torch.empty(b, k, dtype=torch.int64, device=window.device)
    if b:
        kern.ngram_drafts_kernel[(b,)](
            window.contiguous(), valid.contiguous().view(torch.uint8), out, width,
            K=k, K_PAD=kern.next_pow2(k), MIN_N=min_n, MAX_N=max_n,
            BLOCK=kern.next_pow2(width - 1), num_warps=4,
        )  # fmt: skip
    return out


@functools.lru_cache(maxsize=1)
def _kernels():
    """Compiled lazily: importing this module never needs triton."""
    from outrider.layers import fused_kernels

    return fused_kernels
