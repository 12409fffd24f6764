"""The sharded drafter's part of the step channel (tp_channel.py). With
draft_tensor_parallel_size equal to the target's tensor_parallel_size every rank holds its
shard of the EAGLE-3 draft (models/eagle3.py) and runs each of its forwards in lockstep with
rank 0, whose collectives they join. Rank 0 decides every draft token it feeds back (sampled
drafts too); the others read the tokens of the argmax chain from the same all-gathered logits
(identical on every rank), so the spec step's drafting costs them one small broadcast.

What a rank needs beyond the op's payload it keeps from the target forward it followed last:
that forward's attention metadata, positions and aux streams ([T, 3 * Ht], whole on every rank
since the residual stream is) — the draft's input rows are indices into them, never the
streams themselves.

    op DRAFT   mode, tokens T, batch B, table width W, tree-mask width M (0: causal), logits
               rows L, hidden width D (0: rows of the last target forward's aux streams)
               -> one uint8 payload, each part starting 8-byte aligned, in this order:
                  input_ids [T], positions [T], slot_mapping [T], logits rows [L], aux rows
                  [T] (D = 0) as int64, query_start_loc [B + 1], seq_lens [B],
                  block_tables [B, W] as int32, tree_mask [T, M > 0] as uint8, hidden [T, D > 0]
                  in the model's dtype
    op DRAFT_AFTER_VERIFY   batch B, tokens per row R, k_draft, topk, num_steps, num_nodes
               (topk > 1: a tree) -> int64 [B * R + B (+ B * R)]: the tokens each verify row
               (a tree's path) fed the drafter, num_accepted, a tree's path rows; every rank
               then runs Eagle3Drafter.after_verify_no_sync (or the tree's) over the verify it
               just followed.

Cost per draft forward at TP N: all-reduces for the embedding (the target's vocabulary shard),
fc (a forward over the target's streams), o_proj and down_proj; one all-gather for the head
over the draft vocabulary; and on the eager path one header and one payload broadcast.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from outrider.core import ForwardMode
from outrider.executor.tp_payload import pack, packed_size, unpack
from outrider.layers.forward_context import AttentionMetadata
from outrider.speculative.base import DeviceDrafter

if TYPE_CHECKING:  # the runner's modules import this one: at run time a cycle
    from outrider.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

DRAFT = ForwardMode.DRAFT.value
# Step ops of the channel's header (tp_channel.py numbers its own 0-4 and takes these).
OP_DRAFT, OP_DRAFT_AFTER_VERIFY = 5, 6
_MODES = list(ForwardMode)


# -- rank 0 ------------------------------------------------------------------------------------


def send_draft(
    sender,  # tp_channel.StepSender
    input_ids: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    attn: AttentionMetadata,
    rows: torch.Tensor,  # [L] int64 rows the head runs on
    hidden: torch.Tensor | None,  # [T, D] the draft's input, or None: aux_rows
    aux_rows: torch.Tensor | None,  # [T] int64 rows of the last target forward's aux streams
    dtype: torch.dtype,
) -> None:
    """Before rank 0 runs an eager draft forward: the other ranks run the same one."""
    sender.forwards[DRAFT] = sender.forwards.get(DRAFT, 0) + 1
    tables, tree = attn.block_tables, attn.tree_mask
    width = 0 if hidden is None else hidden.shape[-1]
    sender._send_header(
        OP_DRAFT, _MODES.index(attn.mode), input_ids.numel(), tables.shape[0], tables.shape[1],
        0 if tree is None else tree.shape[1], rows.numel(), width,
    )  # fmt: skip
    parts = [(input_ids, torch.int64), (positions, torch.int64), (attn.slot_mapping, torch.int64),
             (rows, torch.int64)]  # fmt: skip
    if hidden is None:
        parts.append((aux_rows, torch.int64))
    parts += [(attn.query_start_loc, torch.int32), (attn.seq_lens, torch.int32),
              (tables, torch.int32)]  # fmt: skip
    if tree is not None:
        parts.append((tree, torch.uint8))
    if hidden is not None:
        parts.append((hidden, dtype))
    sender.tp.broadcast(pack(parts), mode=DRAFT)


def send_after_verify(
    sender,  # tp_channel.StepSender
    tokens: torch.Tensor,  # [B * R] int64
    num_accepted: torch.Tensor,  # [B]
    k_draft: int,
    path_rows: torch.Tensor | None = None,  # [B, R] a tree's accepted path
    shape=None,  # speculative.tree_batch.TreeShape for a tree
) -> None:
    """Before rank 0 drafts inside the speculative step: the others draft alongside it."""
    b = num_accepted.shape[0]
    r = tokens.numel() // b
    forwards = shape.num_steps if shape is not None else k_draft  # the extend, then the rest
    sender.forwards[DRAFT] = sender.forwards.get(DRAFT, 0) + forwards
    if shape is None:
        sender._send_header(OP_DRAFT_AFTER_VERIFY, b, r, k_draft, 1, 0, 0)
    else:
        sender._send_header(
            OP_DRAFT_AFTER_VERIFY, b, r, 0, shape.topk, shape.num_steps, shape.num_nodes
        )
    parts = [tokens.reshape(-1), num_accepted.reshape(-1)]
    if path_rows is not None:
        parts.append(path_rows.reshape(-1))
    sender.tp.broadcast(torch.cat([p.to(torch.int64) for p in parts]), mode=DRAFT)


# -- ranks > 0 ---------------------------------------------------------------------------------


class DraftFollower:
    """A rank > 0's shard of the drafter, following rank 0's draft ops. runner: this rank's
    ModelRunner, whose `drafter` is an Eagle3Drafter over the sharded draft and whose
    `aux_layers` are the drafter's (every target forward keeps them here)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.drafter: DeviceDrafter = runner.drafter
        self.dtype = runner.dtype
        # The target forward followed last: (metadata, positions [T], aux streams [T, 3 * Ht]).
        self._last: tuple[AttentionMetadata, torch.Tensor, torch.Tensor | None] | None = None

    def saw_forward(self, meta: AttentionMetadata, positions: torch.Tensor, aux: list) -> None:
        self._last = (meta, positions, torch.cat(aux, dim=-1) if aux else None)

    def draft(self, recv, mode: int, t: int, b: int, w: int, m: int, n_rows: int, d: int) -> None:
        """op DRAFT: the same eager draft forward as rank 0 (Eagle3Drafter.run_rows)."""
        i64, i32 = torch.int64, torch.int32
        layout = [((t,), i64)] * 3 + [((n_rows,), i64)] + ([((t,), i64)] if d == 0 else [])
        layout += [((b + 1,), i32), ((b,), i32), ((b, w), i32)]
        layout += [((t, m), torch.uint8)] if m else []
        layout += [((t, d), self.dtype)] if d else []
        parts = unpack(recv((packed_size(layout),), torch.uint8), layout)
        ids, positions, slots, rows = parts[:4]
        at = 4
        if d == 0:
            aux_rows, at = parts[4], 5
        qsl, seq_lens, tables = parts[at : at + 3]
        tree = parts[at + 3].view(torch.bool) if m else None
        hidden = parts[-1] if d else self._aux().index_select(0, aux_rows)
        starts = qsl.tolist()  # CPU-GPU sync point (the reference backend plans from the host)
        meta = AttentionMetadata(
            mode=_MODES[mode], slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=tables, query_lens_cpu=[e - s for s, e in zip(starts, starts[1:])],
            seq_lens_cpu=seq_lens.tolist(), tree_mask=tree,
        )  # fmt: skip
        self.drafter.run_rows(ids, positions, meta, hidden, rows)

    def after_verify(
        self, recv, b: int, r: int, k_draft: int, topk: int, num_steps: int, num_nodes: int
    ) -> None:
        """op DRAFT_AFTER_VERIFY: the speculative step's drafting over the verify followed last,
        as rank 0 runs it (executor/spec_step.py, step 3)."""
        from outrider.speculative.tree_batch import TreeShape

        meta, positions, aux = self._last_forward()
        tree = topk > 1
        payload = recv((b * r * (2 if tree else 1) + b,), torch.int64)
        tokens, accepted = payload[: b * r], payload[b * r : b * r + b]
        t = positions.numel() // b  # the verify's rows per sequence
        starts = positions.view(b, t)[:, 0]  # a tree's rows hold root + depth: depth 0 here
        backend = self.runner.backend
        if tree:
            path_rows = payload[b * r + b :].view(b, r)
            rows = (torch.arange(b, device=aux.device)[:, None] * t + path_rows).reshape(-1)
            shape = TreeShape(num_nodes, topk, num_steps)
            self.drafter.tree_after_verify_no_sync(
                tokens.view(b, r), aux.index_select(0, rows), accepted, starts,
                meta.block_tables, shape, backend,
            )  # fmt: skip
        else:
            self.drafter.after_verify_no_sync(
                meta, tokens, positions, aux, accepted, starts, meta.block_tables, k_draft,
                backend,
            )  # fmt: skip

    def _last_forward(self):
        if self._last is None or self._last[2] is None:
            raise RuntimeError(
                f"rank {self.runner.tp.rank}: a draft op came before any target forward with "
                "aux streams: the ranks are out of step"
            )
        return self._last

    def _aux(self) -> torch.Tensor:
        return self._last_forward()[2]
