"""The speculative step's CUDA graphs (executor/spec_step.py): their capture, their replay, and
under tensor parallelism rank 0's send of each replayed step and the other ranks' replay of it.

Per (padded B, k) there is a verify graph (the target forward, logits, argmax and, for chains,
acceptance over the step's static buffers) and, with a drafter or a tree, a draft graph reading
the verify graph's outputs (a tree's acceptance first, so that a fixup between the two can
decide constrained rows' targets); all share one memory pool, captured largest first. A greedy
batch replays the two and reads the host once.

Under tensor parallelism every rank captures the verify graph of each (padded B, k) in the same
order (the all-reduces inside pair up across ranks; executor/tp_graphs.py agrees on the list
first); rank 0 sends each step's buffers with the graph's key before it replays, and the other
ranks copy them into their own static buffers and replay the same graph (`replay_sent`). Their
acceptance is computed and unused; the drafter and its graph run on rank 0 alone. Trees verify
eagerly there (no keys): their accepted nodes' KV moves go to the other ranks from the host,
mid-step, which no graph can do.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from outrider.core import ForwardMode, ScheduledBatch
from outrider.executor.tp_channel import ALL_ROWS, SPEC_GRAPH
from outrider.progress import progress

if TYPE_CHECKING:  # the step holds its graphs: at run time this import would be a cycle
    from outrider.executor.spec_launch import SpecOutput
    from outrider.executor.spec_step import SpecStep

log = logging.getLogger(__name__)


class SpecGraphs:
    """The graphs of one SpecStep; empty until `capture` (and always where graphs are off)."""

    def __init__(self, step: SpecStep) -> None:
        # The step owns its graphs; a strong reference back would be a cycle that keeps a
        # dropped engine's buffers and graph pool alive until the cycle collector runs.
        self._step = weakref.ref(step)
        # (padded B, k, k_draft) -> (verify graph, draft graph or None, the outputs both write,
        # the collectives the verify graph runs)
        self.captured: dict[tuple[int, int, int], tuple] = {}
        self.pool = None

    @property
    def step(self) -> SpecStep:
        return self._step()

    def __len__(self) -> int:
        return len(self.captured)

    def __contains__(self, key: tuple[int, int, int]) -> bool:
        """Whether (padded B, k, k_draft) was captured."""
        return key in self.captured

    def keys(self, ks: Sequence[int]) -> list[tuple[int, int]]:
        """(padded B, k) that `capture` captures, in its order (largest first); none for trees
        under tensor parallelism (the module's doc says why)."""
        step = self.step
        if step.tree is not None and step.tp.size > 1:
            return []
        return [(b, k) for k in sorted(ks, reverse=True) for b in reversed(step.batch_sizes)]

    def capture(self, ks: Sequence[int]) -> None:
        """Per (padded B, k) of `keys(ks)`: a verify graph and, with a drafter, a draft graph
        reading the verify graph's outputs; largest first into one memory pool."""
        step = self.step
        if step.drafter is not None and step.drafter.sharded:  # its other ranks follow eagerly
            from outrider.executor.drafter import SHARDED_GRAPHS

            raise ValueError(SHARDED_GRAPHS)
        if step.tree is not None and step.tp.size > 1:
            log.info(
                "tensor parallelism: the tree step runs eagerly (its KV moves go to the other "
                "ranks from the host mid-step); decode graphs are still replayed"
            )
        keys = self.keys(ks)
        for b, k in progress(keys, "capturing speculative step graphs"):
            self._capture(b, k)
        if keys:
            log.info("captured %d speculative step graphs", len(self.captured))

    def _capture(self, padded: int, k: int) -> None:
        step = self.step
        k_draft = k if step.drafter is not None else 0
        step.load(ScheduledBatch(ForwardMode.VERIFY, []), k, padded)
        with torch.inference_mode():
            # Warm up outside the capture (autotuning, lazy inits); their collectives run,
            # paired with the other ranks' warm-ups, and count nowhere.
            with step.tp.recording():
                for _ in range(2):
                    out = step.verify_no_sync(padded, k, full_width=True, send=False)
                    if k_draft:
                        step.draft_no_sync(out, padded, k, k_draft, full_width=True)
            torch.cuda.synchronize()
            tree = step.tree is not None  # accepted in the second graph, after the fixup
            verify = torch.cuda.CUDAGraph()
            with step.tp.recording() as counted, torch.cuda.graph(verify, pool=self.pool):
                out = step.verify_no_sync(padded, k, full_width=True, send=False, accept=not tree)
            if self.pool is None:
                self.pool = verify.pool()
            draft = None
            if k_draft or tree:  # rank 0 alone: the drafter reduces nothing
                draft = torch.cuda.CUDAGraph()
                with torch.cuda.graph(draft, pool=self.pool):
                    if tree:
                        step.accept_tree_no_sync(out, padded, k, full_width=True)
                    if k_draft:
                        out.drafts = step.draft_no_sync(out, padded, k, k_draft, full_width=True)
        self.captured[(padded, k, k_draft)] = (verify, draft, out, counted)

    def replay(
        self, key: tuple[int, int, int], fixup: Callable[[SpecOutput], None] | None = None
    ) -> SpecOutput:
        """The step on the buffers `load` just wrote, by the graphs captured at `key` (padded B,
        k, k_draft) -> the outputs they write. Rank 0 of several sends the buffers and the key
        first, and the other ranks replay the same verify graph. `fixup` runs between the two
        replays (SpecStep.run_no_sync)."""
        step = self.step
        verify, draft, out, counted = self.captured[key]
        padded, k, _ = key
        if step.sender is not None:
            self._send(padded, k)
        with torch.inference_mode():
            verify.replay()
            step.tp.add_counts(counted, ForwardMode.VERIFY.value)
            if fixup is not None:
                fixup(out)
            if draft is not None:
                draft.replay()
        return out

    def _send(self, padded: int, k: int) -> None:
        """Rank 0: the buffers `load` wrote, and the key of the graph about to replay."""
        step = self.step
        t = 1 + k
        s = step.inputs
        meta = step.metadata(padded, k)  # the table as wide as the load wrote it
        ids, positions = s.input_ids[: padded * t], s.positions[: padded * t]
        key = (SPEC_GRAPH, meta.mode, padded, t)
        step.sender.forward(ids, positions, meta, ALL_ROWS, graph=key)

    def replay_sent(
        self,
        k: int,
        input_ids: torch.Tensor,  # [padded * (1 + k)] int64
        positions: torch.Tensor,  # [padded * (1 + k)] int64
        slot_mapping: torch.Tensor,  # [padded * (1 + k)] int64
        seq_lens: torch.Tensor,  # [padded] int32
        block_tables: torch.Tensor,  # [padded, w] int32, w <= the step's table width
    ) -> None:
        """A rank > 0: rank 0's loaded buffers, as it sent them, into this rank's own, then the
        verify graph rank 0 replays (its logits' all-gather included; nothing is read back)."""
        step = self.step
        padded, w = block_tables.shape
        key = next((x for x in self.captured if x[:2] == (padded, k)), None)
        if key is None:
            raise RuntimeError(
                f"rank {step.tp.rank}: rank 0 replays the verify graph of batch {padded}, k {k}, "
                f"which this rank did not capture (it has {sorted(x[:2] for x in self.captured)}):"
                " the ranks captured different graphs; run with cuda_graphs=False "
                "(--enforce-eager) and report it"
            )
        n, s = input_ids.shape[0], step.inputs
        s.input_ids[:n].copy_(input_ids)
        s.positions[:n].copy_(positions)
        s.slot_mapping[:n].copy_(slot_mapping)
        s.seq_lens[:padded].copy_(seq_lens)
        s.block_tables[:padded, :w].copy_(block_tables)
        s.block_tables[:padded, w:].fill_(step.scratch_block)  # as rank 0's load resets them
        verify, _, _, counted = self.captured[key]
        with torch.inference_mode():
            verify.replay()
        step.tp.add_counts(counted, ForwardMode.VERIFY.value)
