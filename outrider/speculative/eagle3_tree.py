"""EAGLE-3 tree proposals, EAGLE-2 style: grow topk candidates per step for num_steps steps,
then keep the num_draft_tokens nodes with the best cumulative draft log-probability.

Worked example, topk 2, 3 steps, C = the request's computed tokens (root x_C at position C):
    depth 1: the EXTEND's last row (position C - 1) gives the 2 best first drafts a, b.
    step 2 runs a and b (position C, slots C and C+1, each seeing the context and itself);
           their 4 children are scored score(parent) + logp(child), the best 2 kept: say a1, a2.
    step 3 runs a1, a2 (position C+1, slots C+2, C+3, each seeing the context, a's slot C and
           itself) and keeps the best 2 of their 4 children: a1x, a2y.
    nodes {a, b, a1, a2, a1x, a2y}; the best k by score (ties: shallower first) form the tree.
A child's score never exceeds its parent's (log-probabilities are <= 0) and ties go to the
shallower node, so the kept set is closed under parents. Only the final structure crosses to
the host: one sync per proposal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.core import ForwardMode, Request
from outrider.layers.forward_context import AttentionMetadata
from outrider.layers.fused import top_logprobs
from outrider.speculative.base import DeviceDrafter, SeqDrafts
from outrider.transfer import to_device_no_sync

DEFAULT_MAX_STEPS = 5


@dataclass
class Frontier:
    """A request's draft state after the drafter's last EXTEND over it: the first drafts, ready
    for step 2 (executor/drafter.py keeps one per request)."""

    position: int  # the extend's last row (C - 1)
    top_ids: torch.Tensor  # [topk] int64 target ids of the best first drafts, on the device
    top_logp: torch.Tensor  # [topk] float32 their draft log-probabilities
    hidden: torch.Tensor  # [H] the draft's pre-norm output at that row
    logits: torch.Tensor | None  # [draft_vocab] at that row, kept for sampled requests


def propose_trees(
    proposer: DeviceDrafter, reqs: Sequence[Request], frontiers: Sequence[Frontier], k: int
) -> list[SeqDrafts]:
    t = proposer.topk
    steps = proposer.num_steps or min(k, DEFAULT_MAX_STEPS)
    b = len(reqs)
    dev = proposer.device
    ctx = [r.num_computed_tokens for r in reqs]  # C per request
    # 1. depth 1 from the extend: tokens, scores [B, t]; each node's input hidden [B, t, H].
    tokens = torch.stack([f.top_ids[:t] for f in frontiers])
    scores = torch.stack([f.top_logp[:t] for f in frontiers])
    hidden = torch.stack([f.hidden for f in frontiers])[:, None, :].expand(-1, t, -1)
    all_tokens, all_scores, all_parents = [tokens], [scores], [torch.full_like(tokens, -1)]
    # anc[b, i, r]: frontier node i of seq b sees relative slot r (C + r); grows by t a step.
    anc = torch.zeros(b, t, 0, dtype=torch.bool, device=dev)
    for d in range(2, steps + 1):
        # 2. run the depth d-1 nodes at slots C + (d-2)*t + i, rotary position C + d - 2.
        own = torch.eye(t, dtype=torch.bool, device=dev)[None].expand(b, -1, -1)
        anc = torch.cat([anc, own], dim=-1)  # [B, t, (d-1)*t]
        meta, positions = _step_metadata(proposer, reqs, ctx, d, t, anc)
        rows = torch.arange(b * t, device=dev)
        logits, out_hidden = proposer.run_rows(
            tokens.reshape(-1), positions, meta, hidden.reshape(b * t, -1), rows
        )
        # 3. score the t * t children, keep the best t per sequence.
        child_logp, child = top_logprobs(logits, t)  # [B * t, t]
        cum = (scores[:, :, None] + child_logp.view(b, t, t)).view(b, t * t)
        scores, pick = cum.topk(t, dim=-1)  # [B, t]
        parent = pick // t
        tokens = proposer.draft.to_target_ids(child.view(b, t * t).gather(1, pick))
        hidden = out_hidden.view(b, t, -1).gather(
            1, parent[..., None].expand(-1, -1, out_hidden.shape[-1])
        )
        anc = anc.gather(1, parent[..., None].expand(-1, -1, anc.shape[-1]))
        all_tokens.append(tokens)
        all_scores.append(scores)
        all_parents.append(parent)
    # 4. one sync, then the best k nodes per sequence in topological order.
    host = torch.stack(
        [
            torch.stack(all_tokens, 1).float(),
            torch.stack(all_scores, 1),
            torch.stack(all_parents, 1).float(),
        ]
    ).tolist()  # [3][B][steps][t]  # CPU-GPU sync point
    return [_select(host[0][i], host[1][i], host[2][i], k) for i in range(b)]


def _select(tokens, scores, parents, k: int) -> SeqDrafts:
    """tokens/scores/parents: [steps][t]; parents index the previous depth's t nodes."""
    nodes = [(d, i) for d in range(len(tokens)) for i in range(len(tokens[d]))]
    best = sorted(nodes, key=lambda n: (-scores[n[0]][n[1]], n[0], n[1]))[:k]
    keep = sorted(best)  # by depth, then index: parents first
    index = {n: j for j, n in enumerate(keep)}
    out_tokens, out_parents = [], []
    for d, i in keep:
        out_tokens.append(int(tokens[d][i]))
        out_parents.append(-1 if d == 0 else index[(d - 1, int(parents[d][i]))])
    return SeqDrafts(out_tokens, out_parents)


def _step_metadata(
    proposer: DeviceDrafter,
    reqs: Sequence[Request],
    ctx: list[int],
    d: int,
    t: int,
    anc: torch.Tensor,  # [B, t, (d-1)*t]
) -> tuple[AttentionMetadata, torch.Tensor]:  # positions [B * t]
    """Attention metadata for running t frontier nodes per sequence under the tree mask.

    The step's nodes sit at slots C + (d-2)*t .. C + (d-1)*t - 1, so seq_len = C + (d-1)*t and
    the tree's slots C .. C + (d-1)*t - 1 are exactly each sequence's last (d-1)*t keys: `anc`
    ([B, t, (d-1)*t]) is the tree mask as it stands, and every key before C (the context) is
    visible. E.g. topk 2, d 3, C 10: seq_len 14, slots 10..13 = columns 0..3, and a node whose
    parent is the first depth-1 node (slot 10) and which sits at slot 12 has the row 1 . 1 .
    """
    bs = proposer.block_size
    dev = proposer.device
    b = len(reqs)
    first = (d - 2) * t  # relative slot of this step's first node
    slots, seq_lens = [], []
    for r, c in zip(reqs, ctx):
        pos = range(c + first, c + first + t)
        slots += [r.block_ids[p // bs] * bs + p % bs for p in pos]
        seq_lens.append(c + first + t)
    width = max(len(r.block_ids) for r in reqs)
    tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs]
    positions = (to_device_no_sync(ctx, torch.int64, dev) + d - 2).repeat_interleave(t)
    meta = AttentionMetadata(
        mode=ForwardMode.VERIFY,
        slot_mapping=to_device_no_sync(slots, torch.int64, dev),
        query_start_loc=torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=dev),
        seq_lens=to_device_no_sync(seq_lens, torch.int32, dev),
        block_tables=to_device_no_sync(tables, torch.int32, dev),
        query_lens_cpu=[t] * b,
        seq_lens_cpu=seq_lens,
        tree_mask=anc.reshape(b * t, anc.shape[-1]),
    )
    return meta, positions
