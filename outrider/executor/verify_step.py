"""Turns a VERIFY forward's logits into accepted tokens, sequence by sequence.

A sequence with N drafts has 1 + N logits rows: row 0 after the root (the last accepted token),
row 1 + i after draft node i. Each row's target distribution is the one the sampler would draw
from at that point, with the tokens on the path to it counted as already generated (penalties
and min_tokens see them), so acceptance keeps exactly the target's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from outrider.core import ScheduledSeq
from outrider.executor.sampler import (
    Sampler,
    SamplingRow,
    keyed_draws_no_sync,
    logprob_rows_no_sync,
    masked_argmax_no_sync,
    processed_probs,
    unpack_logprobs,
)
from outrider.speculative.tree import TreeTopology, accepted_kv_moves
from outrider.speculative.verify import (
    Verdict,
    verify_chain_batch_no_sync,
    verify_chain_greedy_no_sync,
    verify_greedy,
    verify_sampled,
)
from outrider.transfer import to_device_no_sync


def verify_seq(logits: torch.Tensor, seq: ScheduledSeq) -> Verdict:
    """logits: [1 + N, vocab] for one sequence with drafts."""
    drafts = seq.drafts
    assert drafts is not None and logits.shape[0] == 1 + drafts.num_nodes
    topology = TreeTopology.from_parents(drafts.parents)
    req = seq.request
    params = req.params
    if (
        params.greedy
        and not params.has_penalties
        and len(req.output_token_ids) >= params.min_tokens
    ):
        argmax = logits.argmax(dim=-1).tolist()  # CPU-GPU sync point: tokens to the scheduler
        return verify_greedy(topology, drafts.token_ids, argmax)
    rows = [
        SamplingRow(
            params,
            req.prompt_token_ids,
            req.output_token_ids + _path_tokens(topology, drafts.token_ids, node),
            req.eos_token_ids,
            req.generator,
        )
        for node in range(-1, drafts.num_nodes)
    ]
    target = processed_probs(logits, rows)  # [1 + N, vocab]
    if params.seed is not None and drafts.draft_probs is None:
        # Coupled: every row's token is the one plain sampling draws at that position (keyed
        # noise); a draft is accepted exactly when it is that token. Output equals plain
        # sampling's for the seed; a deterministic draft is accepted with probability p(x), as
        # rejection sampling accepts it.
        draws = keyed_draws_no_sync(target, [r.key for r in rows]).tolist()  # CPU-GPU sync point
        return verify_greedy(topology, drafts.token_ids, draws)
    return verify_sampled(topology, drafts.token_ids, target, drafts.draft_probs, req.generator)


def sample_and_verify(
    sampler: Sampler, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]
) -> tuple[list[list[int]], list[list[int]], list[list[dict[int, float]]] | None]:
    """logits: the rows of every sampling sequence, in order (1 row per plain sequence, 1 + N
    per verifying one). Returns per sequence: new tokens, accepted draft nodes (root-first),
    and logprobs (None when no sequence asked; for a verifying one, each emitted token's from
    the verify row that predicted it)."""
    plain_rows, plain_seqs, spans = [], [], []
    row = 0
    for s in seqs:
        n = 1 + (s.drafts.num_nodes if s.drafts is not None else 0)
        spans.append((row, n))
        if s.drafts is None:
            plain_rows.append(row)
            plain_seqs.append(s)
        row += n
    plain, plain_logprobs = iter([]), None
    if plain_seqs:
        out = sampler(logits[plain_rows], plain_seqs)
        plain = iter(out.token_ids)
        plain_logprobs = iter(out.logprobs) if out.logprobs is not None else None
    tokens, accepted, logprobs = [], [], []
    asked = False
    for s, (start, n) in zip(seqs, spans):
        if s.drafts is None:
            tokens.append([next(plain)])
            accepted.append([])
            logprobs.append([next(plain_logprobs) or {}] if plain_logprobs else [{}])
        else:
            verdict = verify_seq(logits[start : start + n], s)
            tokens.append(verdict.token_ids)
            accepted.append(verdict.accepted_nodes)
            rows = [start] + [start + 1 + node for node in verdict.accepted_nodes]
            logprobs.append(_row_logprobs(logits, rows, verdict.token_ids, s.request.params))
        asked = asked or s.request.params.logprobs is not None
    return tokens, accepted, logprobs if asked else None


def _row_logprobs(
    logits: torch.Tensor, rows: list[int], token_ids: list[int], params
) -> list[dict[int, float]]:
    """{token: logprob} for each emitted token (and the top-N) from the row that predicted it;
    [{}, ...] when the request did not ask."""
    if params.logprobs is None:
        return [{} for _ in token_ids]
    ids = to_device_no_sync(token_ids, torch.int64, logits.device)
    picked = logits.index_select(0, to_device_no_sync(rows, torch.int64, logits.device))
    packed = logprob_rows_no_sync(picked, ids, list(range(len(rows))), params.logprobs)
    return unpack_logprobs(packed.tolist(), token_ids, params.logprobs)  # CPU-GPU sync point


def verify_chain_rows_no_sync(
    logits: torch.Tensor,  # [F * (1 + k), V] the verify rows of F sequences
    seqs: Sequence[ScheduledSeq],  # F sequences: [root] + at most k chain drafts each
    k: int,
    draft_tokens: torch.Tensor,  # [F, k] as the verify saw them (padding past the real ones)
    num_drafts: torch.Tensor,  # [F]
    emitted: torch.Tensor | None = None,  # [F] int64 on the device (see below)
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [F, 1 + k], num_accepted [F]
    """Exact acceptance for rows that sample, penalise or owe min_tokens, all at once on the
    device: row j's target is the sampler's distribution with drafts 0..j-1 counted as
    generated, and drafts are deterministic proposals (what the speculative step drafts).
    emitted: tokens each row's request emitted in a step the host has not read yet (a step
    launched after it, SpecStep.launch_after): a seeded row's output positions, which key its
    noise, are that much further than its request's tokens say."""
    rows = []
    for s in seqs:
        req, drafts = s.request, s.token_ids[1 : 1 + k]
        base = SamplingRow.of_request(req)
        for j in range(1 + k):
            if j == 0 or not (req.params.has_penalties or req.params.min_tokens):
                rows.append(base)  # the path only matters to penalties and min_tokens
            else:
                out = list(req.output_token_ids) + drafts[:j]
                rows.append(SamplingRow(req.params, req.prompt_token_ids, out,
                                        req.eos_token_ids, req.generator))  # fmt: skip
    target = processed_probs(logits, rows).view(len(seqs), 1 + k, -1)
    gens = [s.request.generator for s in seqs]
    tokens, accepted = verify_chain_batch_no_sync(target, draft_tokens, num_drafts, None, gens)
    keyed = [i for i, s in enumerate(seqs) if s.request.params.seed is not None
             and not s.request.params.greedy]  # fmt: skip
    if keyed:  # coupled (verify_seq says why): the draws plain sampling makes, drafts matched
        keys = [(seqs[i].request.params.seed, len(seqs[i].request.output_token_ids) + j)
                for i in keyed for j in range(1 + k)]  # fmt: skip
        idx = to_device_no_sync(keyed, torch.long, target.device)
        offsets = None
        if emitted is not None:
            offsets = emitted.index_select(0, idx).repeat_interleave(1 + k)
        draws = keyed_draws_no_sync(target.index_select(0, idx).flatten(0, 1), keys, offsets)
        draws = draws.view(len(keyed), 1 + k)
        real = torch.arange(k, device=draws.device) < num_drafts.index_select(0, idx)[:, None]
        same = (draft_tokens.index_select(0, idx) == draws[:, :k]) & real
        tokens.index_copy_(0, idx, draws)
        accepted.index_copy_(0, idx, same.long().cumprod(1).sum(1))
    return tokens, accepted


def masked_greedy_chain_no_sync(
    logits: torch.Tensor,  # [B * (1 + k), V] every verify row of the step
    rows: torch.Tensor,  # [F * (1 + k)] int64: the F sequences' rows, each's in order
    bitmask: torch.Tensor,  # [F * (1 + k), W] int32: what each of those rows allows
    draft_tokens: torch.Tensor,  # [F, k] as the verify saw them (padding past the real ones)
    num_drafts: torch.Tensor,  # [F]
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [F, 1 + k], num_accepted [F]
    """Greedy acceptance for constrained rows that are otherwise plain greedy: each row's
    target is the argmax among the tokens its grammar allows (one launch on the GPU, no
    distribution built), and drafts count while they equal it."""
    f, k = draft_tokens.shape
    target = masked_argmax_no_sync(logits, rows, bitmask).view(f, 1 + k)
    return verify_chain_greedy_no_sync(target, draft_tokens, num_drafts.long())


def _path_tokens(topology: TreeTopology, tokens: list[int], node: int) -> list[int]:
    """Draft tokens from the root down to `node` inclusive (empty for the root, node -1)."""
    path = []
    while node != -1:
        path.append(tokens[node])
        node = topology.parents[node]
    return path[::-1]


def tree_kv_slots(
    seqs: Sequence[ScheduledSeq], accepted: Sequence[Sequence[int]], block_size: int
) -> tuple[list[int], list[int]]:
    """KV slot moves (sources, destinations) that put every tree-verified sequence's accepted
    nodes where plain decoding would have written them (speculative/tree.py's
    accepted_kv_moves, per sequence); chains need none. The sequences' slots are disjoint, so
    the moves of all of them apply at once (KVPool.move_no_sync reads before it writes)."""
    src: list[int] = []
    dst: list[int] = []
    for s, nodes in zip(seqs, accepted):
        if s.drafts is None or s.drafts.is_chain or not nodes:
            continue
        topology = TreeTopology.from_parents(s.drafts.parents)
        for a, b in accepted_kv_moves(topology, nodes, s.start_pos):
            src.append(s.block_ids[a // block_size] * block_size + a % block_size)
            dst.append(s.block_ids[b // block_size] * block_size + b % block_size)
    return src, dst
