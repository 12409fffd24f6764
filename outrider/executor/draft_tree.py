"""The EAGLE-3 drafter's tree step on the device (executor/spec_step.py's tree verify, inside
its graphs): extend over the accepted path, then grow the next tree EAGLE-2 style, as
speculative/eagle3_tree.py does eagerly; select_tree_no_sync keeps its best nodes."""

from __future__ import annotations

import torch

from outrider.core import ForwardMode
from outrider.executor.inputs import table_slots_no_sync
from outrider.layers import fused
from outrider.layers.attn_backends.base import AttentionBackend
from outrider.layers.forward_context import AttentionMetadata, ForwardContext, forward_context
from outrider.layers.fused import top_logprobs
from outrider.models.eagle3 import Eagle3Draft
from outrider.speculative.tree_batch import TreeShape, select_tree_no_sync


def grow_tree_no_sync(
    draft: Eagle3Draft,
    block_size: int,
    path_ids: torch.Tensor,  # [B, 1 + S] the target's argmax along the accepted path
    path_aux: torch.Tensor,  # [B * (1 + S), 3 * Ht] the target's aux streams there
    num_accepted: torch.Tensor,  # [B]
    starts: torch.Tensor,  # [B] each row's root position
    block_tables: torch.Tensor,  # [B, W] int32; its last column is the scratch block
    shape: TreeShape,
    backend: AttentionBackend,
) -> tuple[torch.Tensor, torch.Tensor]:  # next tree: tokens [B, N], parents [B, N]
    """The tree step's drafting, all on the device: extend over the accepted path (a chain
    of 1 + S rows from the root; rows past the accepted ones write draft KV that the
    frontier overwrites before anyone reads it), then grow the next tree EAGLE-2 style
    from the row after the last accepted one, as speculative/eagle3_tree.py does eagerly.

    Frontier nodes of depth d (2..S) run at rotary position C + d - 2 and slots
    C + (d - 2) * topk + i, where C = root + num_accepted + 1 is the next root's position;
    each sees the context before C and, among the tree's slots, its ancestors and itself
    (the attention's tree mask over the last (d - 1) * topk keys)."""
    b, rows = path_ids.shape
    t, dev = shape.topk, path_ids.device
    bs, width = block_size, block_tables.shape[1]
    top = draft.rotary_emb.cos.shape[0] - 1

    def metadata(slots, q: int, seq_lens, qsl, tree_mask=None) -> AttentionMetadata:
        # Graph-safe backends read lengths on the device; the reference backend (the CPU,
        # where reading them costs nothing) plans from the host's.
        host = seq_lens.tolist() if dev.type == "cpu" else [width * bs] * b
        return AttentionMetadata(
            ForwardMode.VERIFY, slots, qsl, seq_lens, block_tables, [q] * b, host,
            tree_mask=tree_mask,
        )  # fmt: skip

    def run(meta, ids, pos, hidden):
        backend.prepare(meta)
        with forward_context(ForwardContext(meta, backend)):
            return draft(ids, pos, hidden)

    # 1. Extend over the path; the first candidates come from row num_accepted.
    pos = starts[:, None] + torch.arange(rows, device=dev)[None, :]  # [B, 1 + S]
    qsl = torch.arange(0, (b + 1) * rows, rows, dtype=torch.int32, device=dev)
    slots = table_slots_no_sync(block_tables, pos, bs).reshape(-1)
    meta = metadata(slots, rows, (starts + rows).to(torch.int32), qsl)
    normed, summed = run(meta, path_ids.reshape(-1), pos.reshape(-1).clamp(max=top), path_aux)
    last = torch.arange(b, device=dev) * rows + num_accepted
    scores, cand = top_logprobs(draft.compute_logits(normed[last]), t)  # [B, t]
    tokens = draft.to_target_ids(cand)
    hidden = summed[last][:, None, :].expand(-1, t, -1)  # [B, t, H]
    all_tokens, all_scores = [tokens], [scores]
    all_parents = [torch.full_like(tokens, -1)]
    # 2. Grow: anc[b, i, r] says frontier node i of row b sees tree slot C + r. Every grow
    # step's slots, lengths and rotary positions are computed here at once ([G, B, t]
    # and [G, B], G = S - 1 steps); each step takes its slice (a view, no kernel).
    grow = shape.num_steps - 1
    c = starts + num_accepted + 1
    step_ix = torch.arange(grow, device=dev)[:, None, None]  # [G, 1, 1]
    node_pos = c[None, :, None] + step_ix * t + torch.arange(t, device=dev)  # [G, B, t]
    step_slots = (
        table_slots_no_sync(block_tables, node_pos.permute(1, 0, 2).reshape(b, grow * t), bs)
        .view(b, grow, t)
        .permute(1, 0, 2)
        .contiguous()
    )  # [G, B, t]
    step_lens = (c[None, :] + (step_ix[:, :, 0] + 1) * t).to(torch.int32)  # [G, B]
    step_rope = (c[None, :, None] + step_ix).clamp(max=top).expand(-1, -1, t).contiguous()
    qsl = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=dev)
    own = torch.eye(t, dtype=torch.bool, device=dev)[None].expand(b, -1, -1)
    anc = own.contiguous()  # [B, t, (j + 1) * t] at step j
    h = hidden.shape[-1]
    for j in range(grow):
        meta = metadata(
            step_slots[j].view(-1), t, step_lens[j], qsl, anc.reshape(b * t, -1)
        )  # fmt: skip
        normed, summed = run(
            meta, tokens.reshape(-1), step_rope[j].view(-1), hidden.reshape(b * t, h)
        )
        child_logp, child = top_logprobs(draft.compute_logits(normed), t)  # [B*t, t]
        picked = fused.grow_select(scores, child_logp, child, draft.d2t, summed, anc)
        if picked is not None:  # the GPU: the selection below in one launch
            scores, parent, tokens, hidden, anc = picked
        else:
            cum = (scores[:, :, None] + child_logp.view(b, t, t)).view(b, t * t)
            scores, pick = cum.topk(t, dim=-1)  # [B, t]
            parent = pick // t
            tokens = draft.to_target_ids(child.view(b, t * t).gather(1, pick))
            hidden = summed.view(b, t, h).gather(1, parent[..., None].expand(-1, -1, h))
            anc = anc.gather(1, parent[..., None].expand(-1, -1, anc.shape[-1]))
            anc = torch.cat([anc, own], dim=-1)
        all_tokens.append(tokens)
        all_scores.append(scores)
        all_parents.append(parent)
    return select_tree_no_sync(
        torch.stack(all_tokens, 1), torch.stack(all_scores, 1), torch.stack(all_parents, 1),
        shape.num_nodes,
    )  # fmt: skip
