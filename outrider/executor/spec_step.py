"""One speculative chain step on the device, the same shape every time, replayed as a graph.

A decode-phase batch of B sequences, each verifying its root and up to k drafts, runs as

    1. the target forward over [B, 1 + k] tokens (rows past a sequence's real drafts are
       masked: their KV goes to the scratch block and they can never be accepted)
    2. logits for every row -> argmax [B, 1 + k] -> greedy acceptance: the leading run of
       drafts equal to the target's argmax, capped at the real drafts        (num_accepted [B])
    3. with an EAGLE-3 drafter, its forward over the same [B, 1 + k] rows (each row's next token
       is the target's argmax there: for accepted rows that is the accepted draft), then k - 1
       chain steps from the row after the last accepted one, positions computed on the device
    4. one device->host copy: tokens [B, 1 + k], num_accepted [B], next drafts [B, k]

Steps 1-2 are one CUDA graph per (padded B, k), step 3 another over the first one's outputs,
so a greedy batch replays two graphs and reads the host once. Rows that sample, penalise, ask
for logprobs or still owe min_tokens are decided between the two replays, all at once on the
device, by exact rejection sampling against each row's sampler distribution
(verify_step.verify_chain_rows_no_sync) and written back before the drafter runs.

Worked example, k = 3, a row at start position 10 with drafts [a, b, c], target argmax
[a, b, x, y] at rows 0..3: a and b are accepted, x is the target's own token after them:
tokens [a, b, x, .], num_accepted 2, computed tokens 10 -> 13. The drafter's row 2 (position
12, input x) gives the first next draft; chain steps run at positions 13 and 14.

The graphs, and the tensor-parallel send and replay of each step, are executor/spec_graphs.py.
`run` is the step as the engine calls it: load, the step, and its one host read, unpacked into
a StepOutput (chains: tokens, accept counts, next drafts, logprobs; trees: the path's tokens
and nodes, the next trees).

Slots: a row's real tokens write KV at its own slots (allocated by the scheduler: root, real
drafts and, for a drafter, k - 1 chain positions past the verify); everything else writes to
the scratch block, whose contents nobody reads as a real token's context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from outrider.core import ForwardMode, Request, ScheduledBatch, ScheduledSeq, StepOutput
from outrider.distributed import TPGroup, single
from outrider.executor.cuda_graph import StaticInputs
from outrider.executor.inputs import table_slots_no_sync
from outrider.executor.sampler import (
    apply_token_bitmask_,
    logprob_rows_no_sync,
    masked_argmax,
    masked_argmax_no_sync,
    token_bitmask,
    top_candidates,
)
from outrider.executor.spec_graphs import SpecGraphs
from outrider.executor.spec_launch import SpecLaunch, SpecOutput, TreeLaunch
from outrider.executor.token_drafts import TokenStepDrafter, write_tokens_no_sync
from outrider.executor.tp_channel import ALL_ROWS
from outrider.executor.verify_step import masked_greedy_chain_no_sync, verify_chain_rows_no_sync
from outrider.layers import fused
from outrider.layers.attn_backends.base import AttentionBackend
from outrider.layers.forward_context import AttentionMetadata, ForwardContext, forward_context
from outrider.speculative.base import DeviceDrafter
from outrider.speculative.tree_batch import (
    TreeShape,
    accept_tree_greedy_no_sync,
    ancestors_no_sync,
    tree_kv_moves_no_sync,
)
from outrider.speculative.verify import verify_chain_greedy_no_sync
from outrider.transfer import StagedUpload, to_device_no_sync


def _verify_rows(picked: list[int], t: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The picked sequences' indices on the device, and their verify rows (t each, in order)."""
    idx = to_device_no_sync(picked, torch.long, dev)
    return idx, (idx[:, None] * t + torch.arange(t, device=dev)).reshape(-1)


def _grammar_targets(
    batch: ScheduledBatch, picked: list[int], logits: torch.Tensor, t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The picked sequences' indices on the device, and their targets [F, t] int64 there: at
    each verify row of the path its drafts follow, the argmax among what its grammar allows
    (batch.grammar_paths, from the rows' top logits). Rows off the path hold token 0: no
    accepted node hangs below them, and a chain's rows past its first mismatch never count.
    One host read, and one more per round of rows whose top logits the grammar refuses all."""
    dev = logits.device
    idx, rows = _verify_rows(picked, t, dev)
    top = top_candidates(logits.index_select(0, rows), range(len(picked) * t))  # CPU-GPU sync
    candidates = list(top.values())

    def decide(late: list[tuple[int, int]], masks: torch.Tensor) -> list[int]:
        at = to_device_no_sync([picked[j] * t + row for j, row in late], torch.int64, dev)
        return masked_argmax(logits.index_select(0, at), masks)  # CPU-GPU sync point

    paths = batch.grammar_paths(
        [batch.seqs[i] for i in picked],
        [candidates[j * t : (j + 1) * t] for j in range(len(picked))],
        decide,
    )
    targets = torch.zeros(len(picked), t, dtype=torch.long)
    for j, path in enumerate(paths):
        for row, token in path:
            targets[j, row] = token
    return idx, to_device_no_sync(targets, torch.long, dev)


def _greedy_argmax(req: Request) -> bool:
    """Whether a request's next token is an argmax of its logits as they are (greedy, no
    penalties, no logprobs, min_tokens met), a grammar's mask aside."""
    p = req.params
    return (
        p.greedy
        and not p.has_penalties
        and p.logprobs is None
        and len(req.output_token_ids) >= p.min_tokens
    )


def simple_greedy(seq: ScheduledSeq) -> bool:
    """Whether a row's token is the plain argmax: what step 2 decides on the device (a
    constrained row's is the argmax among the tokens its grammar allows: decided between the
    replays, with the other rows that are not plain)."""
    return plain_greedy(seq.request)


def plain_greedy(req: Request) -> bool:
    """simple_greedy for a request's next row."""
    return _greedy_argmax(req) and req.params.structured_outputs is None


def runs_ahead(req: Request) -> bool:
    """Whether a request's row in a step launched before the step before it is read (SpecStep.
    launch_after) needs nothing from the host but the request's parameters: greedy or sampled,
    with nothing that reads the tokens before it (no penalties, min_tokens owed or grammar);
    logprobs or not. A seeded row's noise is keyed by its output position, which the step
    before's acceptance decides: the device adds it (launch_after's `emitted`)."""
    p = req.params
    return (
        not p.has_penalties
        and len(req.output_token_ids) >= p.min_tokens
        and p.structured_outputs is None
    )


def masked_greedy(seq: ScheduledSeq) -> bool:
    """Whether a row is plain greedy but for its grammar: its token is the argmax among the
    tokens the grammar allows (verify_step.masked_greedy_chain_no_sync, one launch)."""
    return _greedy_argmax(seq.request) and seq.request.params.structured_outputs is not None


class SpecStep:
    """Static buffers, graphs (`graphs`) and the step for chain speculation at one max k, or for
    trees of one shape (`tree`: N nodes verified per step, the drafter growing the next tree)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        drafter: DeviceDrafter | TokenStepDrafter | None,  # None: chain drafts from the host
        *,
        max_k: int,
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        max_positions: int,
        batch_sizes: Sequence[int],
        aux_layers: tuple[int, ...] = (),
        tree: TreeShape | None = None,
        kv_pool=None,  # executor.kv_cache.KVPool: trees move accepted nodes' KV in it
        sender=None,  # executor.tp_channel.StepSender on rank 0 of several, else None
        tp: TPGroup | None = None,  # the model's group: captures record, replays count
        token_pool: torch.Tensor | None = None,  # [slots] int64 (executor/token_drafts.py)
    ) -> None:
        self.model, self.backend, self.drafter = model, backend, drafter
        self.token_pool = token_pool  # every verify writes its rows' tokens there
        self.sender = sender
        self.tp = tp or single()
        self.tree, self.kv_pool = tree, kv_pool
        if tree is not None:
            max_k = tree.num_nodes
            if drafter is None or kv_pool is None:
                raise ValueError("a tree step needs a drafter on the device and the KV pool")
        self.max_k, self.block_size = max_k, block_size
        # Positions a step writes past a row's start (chains: up to 2k - 1): the table is wide
        # enough that every index the device computes lands inside it (on the scratch block
        # past the end).
        self.reach = tree.reach if tree is not None else 2 * max_k
        self.width = max_blocks + -(-self.reach // block_size) + 1
        self.scratch_block, self.max_positions = scratch_block, max_positions
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.aux_layers = aux_layers
        self.device = next(model.parameters()).device
        max_b = self.batch_sizes[-1]
        self.inputs = StaticInputs.allocate(max_b, max_b * (1 + max_k), self.width, self.device)
        self.num_drafts = torch.zeros(max_b, dtype=torch.int64, device=self.device)
        self.num_blocks = torch.zeros(max_b, dtype=torch.int64, device=self.device)  # real ones
        if tree is not None:  # each row's tree: parents, depths, the mask over its 1 + N rows
            n = tree.num_nodes
            self.parents = torch.full((max_b, n), -1, dtype=torch.int64, device=self.device)
            self.depth = torch.ones(max_b, n, dtype=torch.int64, device=self.device)
            self.anc = torch.zeros(max_b, 1 + n, 1 + n, dtype=torch.bool, device=self.device)
        self.upload = StagedUpload(self.device)
        self.inputs.block_tables.fill_(scratch_block)
        self._dirty = 0  # table columns that may hold real blocks, from the widest load since
        self._w = 1  # the table width the last load wrote (eager forwards read only that)
        self.graphs = SpecGraphs(self)  # captured by the runner once aux streams are known

    # -- host -> static buffers ----------------------------------------------------------------

    def padded_batch(self, b: int) -> int | None:
        return next((s for s in self.batch_sizes if s >= b), None)

    def load(self, batch: ScheduledBatch, k: int, padded: int) -> None:
        """Copy the batch's rows into the static buffers as [padded, 1 + k]: drafts past k
        are dropped, missing ones masked; rows past len(batch.seqs) are all scratch. Python
        touches each row once; everything per token is NumPy.

        Block tables are written only as wide as this batch needs (its longest table, the
        chain's last position, and one scratch column that every out-of-table position is
        clamped to); columns a wider earlier batch left are reset to scratch."""
        t = 1 + k
        bs, scratch = self.block_size, self.scratch_block
        starts = np.zeros(padded, np.int64)
        ns = np.zeros(padded, np.int64)
        ntab = np.zeros(padded, np.int64)
        ids = np.zeros((padded, t), np.int64)
        tree = self.tree is not None
        parents = np.full((padded, k), -1, np.int64) if tree else None
        reach = self.tree.reach if tree else 2 * k
        w = 1
        for i, s in enumerate(batch.seqs):
            n = min(k, s.query_len - 1)
            starts[i], ns[i], ntab[i] = s.start_pos, n, len(s.block_ids)
            ids[i, : 1 + n] = s.token_ids[: 1 + n]
            ids[i, 1 + n :] = s.token_ids[0]
            if tree and n:
                parents[i, :n] = s.drafts.parents[:n]
            w = max(w, len(s.block_ids), (s.start_pos + reach) // bs + 1)
        w = min(w + 1, self.width)
        tables = np.full((padded, w), scratch, np.int64)
        for i, s in enumerate(batch.seqs):
            row = s.block_ids[:w]
            tables[i, : len(row)] = row
        ar = np.arange(t)
        pos = starts[:, None] + ar[None, :]  # [padded, t]; padding rows: 0 .. t - 1
        real = (ar[None, :] <= ns[:, None]) & (pos // bs < ntab[:, None])
        col = np.minimum(pos // bs, w - 1)
        own = np.take_along_axis(tables, col, axis=1) * bs + pos % bs
        # Masked rows write inside the scratch block (a step may hold more tokens than a block:
        # trees of 16+ nodes, chains of k >= 16), where collisions are harmless.
        slots = np.where(real, own, scratch * bs + ar[None, :] % bs)
        # Trees: every row's positions are its root's here; the verify adds each node's depth
        # on the device (a node's rotary position is root + depth, its slot root + 1 + index).
        rope = np.repeat(starts[:, None], t, axis=1) if tree else pos
        parts = [ids, np.minimum(rope, self.max_positions - 1), slots, starts + t, tables, ns, ntab]
        if tree:
            parts.append(parents)
        n_tok = padded * t
        s = self.inputs
        sent = self.upload.send(parts)  # one host->device copy
        s.input_ids[:n_tok].copy_(sent[0].view(-1))
        s.positions[:n_tok].copy_(sent[1].view(-1))
        s.slot_mapping[:n_tok].copy_(sent[2].view(-1))
        s.seq_lens[:padded].copy_(sent[3])
        s.block_tables[:padded, :w].copy_(sent[4])
        self.num_drafts[:padded].copy_(sent[5])
        self.num_blocks[:padded].copy_(sent[6])
        if tree:
            self.parents[:padded].copy_(sent[7])
        self._reset_columns(w)

    def _reset_columns(self, w: int) -> None:
        """The tables were written `w` wide: columns a wider earlier batch left are scratch."""
        if self._dirty > w:  # a wider batch wrote real blocks there earlier
            self.inputs.block_tables[:, w : self._dirty].fill_(self.scratch_block)
        self._dirty, self._w = w, w

    def load_after(
        self, batch: ScheduledBatch, k: int, padded: int, b: int, joined: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host's part of the step after a launched one (launch_after), before its tokens
        are read: each row's block table (allocated for the furthest it can reach, its root
        k + 1 positions on and a drafter's chain past its own k + 1), written as wide as that,
        and on the device -> (live [padded]: the rows advanced from the launched step's outputs,
        its first b but those in `joined`; ids [padded, 1 + k] and starts [padded] of the
        others: a joined row's root at its start, verifying nothing; padding rows' zeros)."""
        bs, t = self.block_size, 1 + k
        w = 1
        for s in batch.seqs:
            w = max(w, len(s.request.block_ids), (s.start_pos + 1 + k + self.reach) // bs + 1)
        w = min(w + 1, self.width)
        tables = np.full((padded, w), self.scratch_block, np.int64)
        ntab = np.zeros(padded, np.int64)
        for i, s in enumerate(batch.seqs):
            row = s.request.block_ids[:w]
            tables[i, : len(row)] = row
            ntab[i] = len(s.request.block_ids)
        live = np.zeros(padded, np.int64)
        live[:b] = 1
        ids = np.zeros((padded, t), np.int64)
        starts = np.zeros(padded, np.int64)
        for i in joined:
            s = batch.seqs[i]
            live[i], ids[i], starts[i] = 0, s.token_ids[0], s.start_pos
        sent = self.upload.send([tables, ntab, live, ids, starts])
        self.inputs.block_tables[:padded, :w].copy_(sent[0])
        self.num_blocks[:padded].copy_(sent[1])
        self._reset_columns(w)
        return sent[2].bool(), sent[3], sent[4]

    def advance_no_sync(
        self,
        out: SpecOutput,
        live: torch.Tensor,  # [padded] bool: rows one accepted run further than out's
        ids: torch.Tensor,  # [padded, 1 + k] the other rows' (load_after)
        starts: torch.Tensor,  # [padded]
        k: int,
    ) -> None:
        """The step after `out`'s, on the static buffers: each live row one accepted run
        further, from out's tensors on the device, its root the target's token after the
        accepted drafts and its k drafts the drafter's (out.drafts), all verified; the others
        (rows joining from the host, padding) at their root alone. Slots as `load` makes
        them, from the tables load_after wrote. `out` may cover fewer rows than the step (it
        grew by joined rows).

        Row at start 10 with num_accepted 2, tokens [a, b, x, .], drafts [d, e, f] (k = 3):
        -> ids [x, d, e, f] at positions 13..16 (a tree: every row at 13, the nodes' depths
        added by the verify, and out's next tree's parents)."""
        t = 1 + k
        padded = live.shape[0]
        s, dev, bs = self.inputs, self.device, self.block_size
        n = padded * t
        acc = _rows(out.num_accepted, padded)
        first = s.positions[:n].view(padded, t)[:, 0]
        starts = torch.where(live, first + acc + 1, starts)
        root = _rows(out.tokens, padded).gather(1, acc[:, None])
        advanced = torch.cat([root, _rows(out.drafts, padded)[:, :k]], dim=1)
        ids = torch.where(live[:, None], advanced, ids)
        ns = torch.where(live, k, 0)
        ar = torch.arange(t, device=dev)
        pos = starts[:, None] + ar[None, :]
        tables = s.block_tables[:padded, : self._w].long()
        own = tables.gather(1, (pos // bs).clamp(max=self._w - 1)) * bs + pos % bs
        real = (ar[None, :] <= ns[:, None]) & (pos // bs < self.num_blocks[:padded, None])
        slots = torch.where(real, own, self.scratch_block * bs + ar[None, :] % bs)
        rope = pos
        if self.tree is not None:  # out's next trees; every row at its root's position (`load`)
            parents = _rows(out.draft_parents, padded)
            self.parents[:padded].copy_(torch.where(live[:, None], parents, -1))
            rope = starts[:, None].expand(padded, t)
        s.input_ids[:n].copy_(ids.reshape(-1))
        s.positions[:n].copy_(rope.clamp(max=self.max_positions - 1).reshape(-1))
        s.slot_mapping[:n].copy_(slots.reshape(-1))
        s.seq_lens[:padded].copy_(starts + t)
        self.num_drafts[:padded].copy_(ns)

    def metadata(self, padded: int, k: int, full_width: bool = False) -> AttentionMetadata:
        """full_width: the whole table (what a graph is captured with; kernels read only up to
        each length); eagerly, only what the last load wrote (the reference backend gathers
        every column)."""
        t = 1 + k
        s = self.inputs
        qsl = torch.arange(0, (padded + 1) * t, t, dtype=torch.int32, device=self.device)
        s.query_start_loc[: padded + 1].copy_(qsl)
        return AttentionMetadata(
            mode=ForwardMode.VERIFY if k else ForwardMode.DECODE,
            slot_mapping=s.slot_mapping[: padded * t],
            query_start_loc=s.query_start_loc[: padded + 1],
            seq_lens=s.seq_lens[:padded],
            block_tables=self._block_tables(padded, full_width),
            query_lens_cpu=[t] * padded,
            # Lengths come from device tensors (graph-safe backends); on the CPU the reference
            # backend reads them from the host lists, filled by _host_lengths.
            seq_lens_cpu=[(self.width if full_width else self._w) * self.block_size] * padded,
            tree_mask=self.anc[:padded].view(padded * t, t) if self.tree is not None else None,
        )

    def _block_tables(self, padded: int, full_width: bool) -> torch.Tensor:
        """[padded, width] of the static block tables: the whole width or the last load's."""
        return self.inputs.block_tables[:padded, : self.width if full_width else self._w]

    def _host_lengths(self, meta: AttentionMetadata) -> None:
        """The reference backend plans per sequence from host lengths; on the CPU reading the
        tensor costs nothing (no device to wait for)."""
        if self.device.type == "cpu":
            meta.seq_lens_cpu = meta.seq_lens.tolist()

    # -- the step ---------------------------------------------------------------------------

    def verify_no_sync(
        self,
        padded: int,
        k: int,
        full_width: bool = False,
        send: bool = True,
        accept: bool = True,
    ) -> SpecOutput:
        """Steps 1-2 on the static buffers. send: rank 0 of several sends the forward's inputs
        to the other ranks first (not while capturing: they capture alongside). Trees with
        accept=False stop before acceptance (`accept_tree_no_sync`): out.argmax holds every
        row's target, out.tokens and out.num_accepted are not set."""  # fmt: skip
        t = 1 + k
        s = self.inputs
        meta = self.metadata(padded, k, full_width)
        self._host_lengths(meta)
        ids = s.input_ids[: padded * t]
        positions = s.positions[: padded * t]
        if self.tree is not None:  # the trees' masks and depths, and the nodes' positions
            anc, depth = ancestors_no_sync(self.parents[:padded], self.tree.num_steps)
            self.anc[:padded].copy_(anc)
            self.depth[:padded].copy_(depth)
            zero = torch.zeros(padded, 1, dtype=depth.dtype, device=depth.device)
            rope = positions.view(padded, t) + torch.cat([zero, depth], dim=1)
            positions = rope.clamp_(max=self.max_positions - 1).view(-1)
        if self.sender is not None and send:  # the others verify too, logits for every row
            self.sender.forward(ids, positions, meta, ALL_ROWS)
        if self.token_pool is not None:
            write_tokens_no_sync(self.token_pool, meta.slot_mapping, ids)
        self.backend.prepare(meta)
        with forward_context(ForwardContext(meta, self.backend)):
            hidden, aux = self.model(ids, positions, self.aux_layers)
        logits = self.model.compute_logits(hidden)  # [padded * t, vocab]
        argmax = logits.argmax(dim=-1).view(padded, t)
        aux_cat = torch.cat(aux, dim=-1) if aux else None
        if self.tree is not None:
            out = SpecOutput(argmax, argmax[:, 0], logits, aux_cat, argmax=argmax)
            return self.accept_tree_no_sync(out, padded, k, full_width) if accept else out
        _, accepted = verify_chain_greedy_no_sync(
            argmax, ids.view(padded, t)[:, 1:], self.num_drafts[:padded]
        )
        return SpecOutput(argmax, accepted, logits, aux_cat)

    def accept_tree_no_sync(
        self, out: SpecOutput, padded: int, k: int, full_width: bool = False
    ) -> SpecOutput:
        """Greedy tree acceptance of out.argmax, the accepted nodes' KV moved into path order,
        and the outputs gathered along the path (so the drafter extends over a chain): out's
        tokens, num_accepted, aux and path_rows set, in place; returns it."""
        t = 1 + k
        argmax, aux = out.argmax, out.aux
        drafts = self.inputs.input_ids[: padded * t].view(padded, t)[:, 1:]
        steps = self.tree.num_steps
        starts = self.inputs.positions[: padded * t].view(padded, t)[:, 0]
        tables, bs = self._block_tables(padded, full_width), self.block_size
        tree = (self.parents[:padded], self.anc[:padded], self.depth[:padded])
        fused_out = fused.accept_tree(
            argmax, drafts, *tree, self.num_drafts[:padded], starts, tables, bs, steps
        )
        if fused_out is not None:  # one launch on the GPU
            path_rows, accepted, tokens, src, dst = fused_out
        else:
            path_rows, accepted = accept_tree_greedy_no_sync(
                argmax, drafts, *tree, self.num_drafts[:padded], steps
            )
            tokens = argmax.gather(1, path_rows)  # [padded, 1 + S]
            src, dst = tree_kv_moves_no_sync(path_rows, accepted, starts)
            src = table_slots_no_sync(tables, src, bs)
            dst = table_slots_no_sync(tables, dst, bs)
        src, dst = src.reshape(-1), dst.reshape(-1)
        if self.sender is not None:  # every rank moves its own KV heads' entries
            self.sender.move_kv(src, dst)
        self.kv_pool.move_no_sync(src, dst)
        if aux is not None:
            rows = (torch.arange(padded, device=aux.device)[:, None] * t + path_rows).reshape(-1)
            aux = aux.index_select(0, rows)
        out.tokens, out.num_accepted, out.aux, out.path_rows = tokens, accepted, aux, path_rows
        return out

    def draft_no_sync(
        self, out: SpecOutput, padded: int, k: int, k_draft: int, full_width: bool = False
    ) -> torch.Tensor:
        """Step 3: the drafter over the verify's rows, then the chain -> [padded, k_draft]."""
        t = 1 + k
        s = self.inputs
        meta = self.metadata(padded, k, full_width)
        self._host_lengths(meta)
        positions = s.positions[: padded * t]
        starts = positions.view(padded, t)[:, 0]
        if self.tree is not None:
            drafts, out.draft_parents = self.drafter.tree_after_verify_no_sync(
                out.tokens, out.aux, out.num_accepted, starts, meta.block_tables, self.tree,
                self.backend, path_rows=out.path_rows,
            )  # fmt: skip
            return drafts
        return self.drafter.after_verify_no_sync(
            meta, out.tokens.reshape(-1), positions, out.aux, out.num_accepted, starts,
            meta.block_tables, k_draft, self.backend,
        )  # fmt: skip

    def run_no_sync(
        self, batch: ScheduledBatch, k: int, k_draft: int, fixup=None
    ) -> tuple[SpecOutput, int]:
        """Load the batch and run the step (graphs where captured, else eagerly) -> (outputs
        for the padded batch, padded B). `fixup(out)`, when given, runs between acceptance and
        drafting and rewrites out.tokens / out.num_accepted in place for rows that are not
        plain greedy; the drafter then starts from what it decided. Trees: between the verify
        and acceptance, rewriting out.argmax (run_tree)."""
        padded = self.padded_batch(len(batch.seqs)) or len(batch.seqs)
        self.load(batch, k, padded)
        return self._step_no_sync(padded, k, k_draft, fixup), padded

    def _step_no_sync(self, padded: int, k: int, k_draft: int, fixup=None) -> SpecOutput:
        """The step on what the static buffers hold: graphs where captured, else eagerly."""
        key = (padded, k, k_draft)
        if key in self.graphs:
            return self.graphs.replay(key, fixup)
        with torch.inference_mode():
            tree = self.tree is not None
            out = self.verify_no_sync(padded, k, accept=not tree)
            if fixup is not None:
                fixup(out)
            if tree:
                self.accept_tree_no_sync(out, padded, k)
            if k_draft:
                out.drafts = self.draft_no_sync(out, padded, k, k_draft)
        return out

    # -- steps launched without their read (engine/overlap.py) ------------------------------

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, k: int, k_draft: int) -> SpecLaunch:
        """A step without its read (`run` and `run_tree` read it at once): queued, its outputs
        on their way to the host; SpecLaunch.read waits for them. A step launched after it
        (launch_after) needs drafts on the device (k_draft = k) and rows `runs_ahead` (a
        tree's: `simple_greedy`)."""
        if self.tree is not None:
            return self._launch_tree(batch)
        packed: list[torch.Tensor] = []
        fixup, asked, top_n = self._fixup(batch, k, packed)
        out, padded = self.run_no_sync(batch, k, k_draft, fixup)
        return SpecLaunch(out, len(batch.seqs), padded, k, packed, asked, top_n)

    @torch.inference_mode()
    def launch_after(
        self, prev: SpecLaunch, batch: ScheduledBatch, joined: Sequence[int] = ()
    ) -> SpecLaunch:
        """The step after `prev`, queued on prev's outputs still on the device (advance_no_sync)
        before the host has read them. `batch` is its rows: prev's, each one accepted run
        further and verifying the k drafts prev drafted, but those in `joined`: requests
        decoding from the host's tokens (their root, no drafts: the drafter drafts their first
        k inside this step), in the place of rows whose requests finished or past prev's. Every
        row's blocks must reach its furthest position there (load_after). Trees: prev's next
        trees, every row greedy (TreeLaunch)."""
        padded = max(prev.padded, self.padded_batch(len(batch.seqs)) or len(batch.seqs))
        live, ids, starts = self.load_after(batch, prev.k, padded, prev.b, joined)
        rows = {i: batch.seqs[i] for i in joined}
        if self.tree is not None:  # every row plain greedy: nothing to decide between replays
            self.advance_no_sync(prev.out, live, ids, starts, prev.k)
            out = self._step_no_sync(padded, prev.k, prev.k)
            return TreeLaunch(out, len(batch.seqs), padded, prev.k, self.tree.reach, rows)
        # What prev's rows emitted (0: a joined row's output positions are the host's), before
        # the replay below overwrites prev's outputs.
        emitted = torch.where(live, _rows(prev.out.num_accepted, padded) + 1, 0)
        self.advance_no_sync(prev.out, live, ids, starts, prev.k)
        # Each row's sampling decided from its parameters (and, seeded, its output position:
        # the host's and what prev emitted).
        packed: list[torch.Tensor] = []
        fixup, asked, top_n = self._fixup(batch, prev.k, packed, emitted)
        out = self._step_no_sync(padded, prev.k, prev.k, fixup)
        return SpecLaunch(out, len(batch.seqs), padded, prev.k, packed, asked, top_n, rows)

    # -- the step as the engine runs it: one host read --------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, k: int, k_draft: int) -> StepOutput:
        """A decode-phase batch (every sequence samples; chain drafts, at most k each) through
        the step: verify, accept and draft k_draft next drafts on the device, then one host
        read. Rows that are not plain greedy are decided exactly between acceptance and
        drafting, still on the device: greedy rows held to a grammar by the argmax among
        what it allows (masked_greedy_chain_no_sync), the others from their sampler's
        distribution (verify_chain_rows_no_sync); rows asking for logprobs
        get them for every emitted token from the row that predicted it. Trees: `run_tree`."""
        if self.tree is not None:
            return self.run_tree(batch)
        return self.launch(batch, k, k_draft).read(batch)  # CPU-GPU sync point

    def _fixup(
        self,
        batch: ScheduledBatch,
        k: int,
        packed: list[torch.Tensor],
        emitted: torch.Tensor | None = None,  # [padded] int64: launch_after's
    ):
        """What `run` decides between acceptance and drafting for rows that are not plain
        greedy -> (fixup, or None where every row is; the rows asking for logprobs; their
        most top logprobs). The fixup appends those rows' logprobs, packed, to `packed`.
        emitted: tokens each row emitted in the step before, not read yet (seeded rows' output
        positions, verify_chain_rows_no_sync)."""
        seqs = batch.seqs
        t = 1 + k
        fix = [i for i, s in enumerate(seqs) if not simple_greedy(s)]
        # Greedy rows but for their grammar: picked on the host from their top logits
        # (ScheduledSeq.grammar_topk), or by their masks (laid out by Grammars.attach_masks,
        # filled while the device verifies); the rest sample, penalise or ask for logprobs.
        picked = [i for i in fix if seqs[i].grammar_topk]
        masked = [i for i in fix if masked_greedy(seqs[i]) and seqs[i].token_masks is not None]
        rest = sorted(set(fix) - set(masked) - set(picked))
        asked = [i for i in rest if seqs[i].request.params.logprobs is not None]
        top_n = max((seqs[i].request.params.logprobs for i in asked), default=0)

        def fixup(out: SpecOutput) -> None:
            batch.ready_masks()  # on the host while the device verifies
            dev = out.tokens.device
            drafts = self.inputs.input_ids[: out.tokens.numel()].view(-1, t)[:, 1:]
            if picked:
                idx, target = _grammar_targets(batch, picked, out.logits, t)
                tokens, accepted = verify_chain_greedy_no_sync(
                    target, drafts.index_select(0, idx), self.num_drafts.index_select(0, idx).long()
                )
                out.tokens.index_copy_(0, idx, tokens)
                out.num_accepted.index_copy_(0, idx, accepted)
            if masked:
                idx, rows = _verify_rows(masked, t, dev)
                masks = token_bitmask([seqs[i] for i in masked], [t] * len(masked))
                tokens, accepted = masked_greedy_chain_no_sync(
                    out.logits, rows, to_device_no_sync(masks, torch.int32, dev),
                    drafts.index_select(0, idx), self.num_drafts.index_select(0, idx),
                )  # fmt: skip
                out.tokens.index_copy_(0, idx, tokens)
                out.num_accepted.index_copy_(0, idx, accepted)
            if not rest:
                return
            masks = token_bitmask([seqs[i] for i in rest], [t] * len(rest))
            idx, rows = _verify_rows(rest, t, dev)
            logits = out.logits.index_select(0, rows)  # [F * t, V]
            if masks is not None:  # structured outputs: each row's allowed tokens
                apply_token_bitmask_(logits, to_device_no_sync(masks, torch.int32, dev))
            tokens, accepted = verify_chain_rows_no_sync(
                logits, [seqs[i] for i in rest], k, drafts.index_select(0, idx),
                self.num_drafts.index_select(0, idx),
                emitted.index_select(0, idx) if emitted is not None else None,
            )  # fmt: skip
            out.tokens.index_copy_(0, idx, tokens)
            out.num_accepted.index_copy_(0, idx, accepted)
            if asked:
                lp_rows = [rest.index(i) * t + j for i in asked for j in range(t)]
                ids = tokens.reshape(-1)
                packed.append(logprob_rows_no_sync(logits, ids, lp_rows, top_n))

        return (fixup if fix else None), asked, top_n

    @torch.inference_mode()
    def run_tree(self, batch: ScheduledBatch) -> StepOutput:
        """`run` for trees: every row greedy, plain or held to a grammar (the engine sends
        other batches through the runner's eager `run`). A constrained row's target at each
        node is the argmax among what its grammar allows after the path there (its masks,
        Grammars.attach_masks), decided between the verify and the acceptance, while the
        masks were filled as the device verified. One read: the path's tokens and rows, the
        accept counts, the next trees."""
        return self._launch_tree(batch).read(batch)  # CPU-GPU sync point

    def _launch_tree(self, batch: ScheduledBatch) -> TreeLaunch:
        """run_tree without its read."""
        seqs = batch.seqs
        b, n = len(seqs), self.tree.num_nodes
        t = 1 + n
        picked = [i for i, s in enumerate(seqs) if s.grammar_topk]
        masked = [i for i, s in enumerate(seqs) if masked_greedy(s) and not s.grammar_topk]
        if len(picked) + len(masked) + sum(map(simple_greedy, seqs)) < b or any(
            seqs[i].token_masks is None for i in masked
        ):
            raise ValueError("the tree step decides greedy rows only: use run()")

        def fixup(out: SpecOutput) -> None:
            batch.ready_masks()  # on the host while the device verifies
            dev = out.argmax.device
            if picked:
                idx, target = _grammar_targets(batch, picked, out.logits, t)
                out.argmax.index_copy_(0, idx, target)
            if masked:
                idx, rows = _verify_rows(masked, t, dev)
                masks = token_bitmask([seqs[i] for i in masked], [t] * len(masked))
                target = masked_argmax_no_sync(
                    out.logits, rows, to_device_no_sync(masks, torch.int32, dev)
                )
                out.argmax.index_copy_(0, idx, target.view(len(masked), t))

        out, padded = self.run_no_sync(batch, n, n, fixup if picked or masked else None)
        return TreeLaunch(out, b, padded, n, self.tree.reach)


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x's first n rows, zeros past its own (a step that grew past the one before it)."""
    if x.shape[0] >= n:
        return x[:n]
    return torch.cat([x, x.new_zeros((n - x.shape[0], *x.shape[1:]))])
