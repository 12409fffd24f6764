"""A speculative step's outputs: on the device (SpecOutput, what the graphs write) and on their
way to the host (SpecLaunch: one packed copy toward pinned memory, queued where the step ends,
read when the engine asks for it). SpecStep (executor/spec_step.py) makes both."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from outrider.core import ScheduledBatch, ScheduledSeq, StepOutput
from outrider.executor.sampler import unpack_logprobs
from outrider.speculative.base import SeqDrafts
from outrider.transfer import HostCopy


@dataclass
class SpecOutput:
    """Device tensors of one step; row b of the batch is row b here."""

    tokens: torch.Tensor  # [B, 1 + k] int64: argmax per row (accepted drafts, then the target's)
    num_accepted: torch.Tensor  # [B] int64
    logits: torch.Tensor  # [B * (1 + k), vocab]
    aux: torch.Tensor | None  # [B * (1 + k), n_aux * hidden] for the drafter
    drafts: torch.Tensor | None = None  # [B, k_draft] int64 next drafts (a drafter's)
    # Trees: tokens and aux follow the accepted path ([B, 1 + S] rows: the root, the accepted
    # nodes, then repeats of the last), path_rows [B, 1 + S] says which verify rows those were,
    # draft_parents [B, N] the next tree's shape (drafts its tokens).
    path_rows: torch.Tensor | None = None
    draft_parents: torch.Tensor | None = None
    # Trees: [B, 1 + N] the target's token at every verify row, which acceptance reads (a
    # fixup between the two graphs rewrites a constrained row's: SpecStep.run_tree).
    argmax: torch.Tensor | None = None


def _unpack_chain(
    host: list, b: int, t: int, kd: int | None
) -> tuple[list[list[int]], list[int], list[SeqDrafts] | None]:
    """A chain step's read, [tokens (b x t), num_accepted (b), drafts (b x kd)] flat (ints,
    or floats carrying ints exactly) -> each row's emitted tokens (its accepted drafts and
    the target's token after them), accept counts, next drafts (None when the step has no
    drafter, kd None; empty chains when it drafted none, kd 0: `propose` drafts then)."""
    accepted = [int(x) for x in host[b * t : b * t + b]]
    tokens = [[int(x) for x in host[i * t : i * t + accepted[i] + 1]] for i in range(b)]
    pos = b * t + b
    drafts = None
    if kd is not None:
        rows = (host[pos + i * kd : pos + (i + 1) * kd] for i in range(b))
        drafts = [SeqDrafts.chain([int(x) for x in row]) for row in rows]
    return tokens, accepted, drafts


def _chain_output(batch: ScheduledBatch, tokens, accepted, drafts, logprobs=None) -> StepOutput:
    return StepOutput(
        [s.request.request_id for s in batch.seqs], tokens, num_accepted=accepted,
        logprobs=logprobs, accepted_nodes=[list(range(a)) for a in accepted], next_drafts=drafts,
    )  # fmt: skip


class SpecLaunch:
    """A chain step whose read is still to come (SpecStep.run reads it at once; launch and
    launch_after later): its outputs on the device (`out`, which the next replay of the same
    graph overwrites: launch_after reads them before it replays) and, packed into one tensor,
    on their way to the host: tokens, accept counts, drafts and the logprob rows the fixup
    packed for the `asked` rows (float64 then carries ids and logprobs exactly)."""

    def __init__(
        self,
        out: SpecOutput,
        b: int,
        padded: int,
        k: int,
        packed: Sequence[torch.Tensor] = (),
        asked: Sequence[int] = (),
        top_n: int = 0,
        joined: dict[int, ScheduledSeq] | None = None,
    ) -> None:
        self.out, self.b, self.padded, self.k = out, b, padded, k
        # Rows that joined from the host (their ScheduledSeq by row), launch_after's.
        self.joined = joined or {}
        self._asked, self._top_n = list(asked), top_n
        self._host = HostCopy(self._packed(packed))

    def _packed(self, packed: Sequence[torch.Tensor]) -> torch.Tensor:
        """What the read brings back, in one tensor."""
        out, b = self.out, self.b
        parts = [out.tokens[:b].reshape(-1), out.num_accepted[:b]]
        if out.drafts is not None:
            parts.append(out.drafts[:b].reshape(-1))
        if packed:
            parts = [p.double() for p in parts] + [packed[0].reshape(-1)]
        return torch.cat(parts)

    @property
    def drafted(self) -> bool:
        """Whether the step drafted its rows' next k on the device (a drafter that hands back
        none, width 0, leaves them to `propose`: nothing to launch a step after it on)."""
        return self.out.drafts is not None and self.out.drafts.shape[1] >= self.k

    @property
    def reach(self) -> int:
        """Positions past a row's tokens once this step is read that the step after it, run
        ahead, writes: its own root and k drafts, and the drafter's chain past the accepted."""
        return 2 * self.k

    def read(self, batch: ScheduledBatch) -> StepOutput:
        """The step's output for `batch`, the host's view of the rows it ran (waits for it)."""
        host = self._host.tolist()  # CPU-GPU sync point: this step's outputs only
        b, t = self.b, 1 + self.k
        kd = self.out.drafts.shape[1] if self.out.drafts is not None else None
        tokens, accepted, drafts = _unpack_chain(host, b, t, kd)
        logprobs = None
        if self._asked:
            width, top_n = 1 + 2 * self._top_n, self._top_n
            recs = host[b * (t + 1 + (kd or 0)) :]
            logprobs = [[{} for _ in tok] for tok in tokens]
            for a, i in enumerate(self._asked):
                mine = [recs[(a * t + j) * width : (a * t + j + 1) * width] for j in range(t)]
                n = batch.seqs[i].request.params.logprobs
                logprobs[i] = unpack_logprobs(mine[: len(tokens[i])], tokens[i], top_n, n)
        return _chain_output(batch, tokens, accepted, drafts, logprobs)


class TreeLaunch(SpecLaunch):
    """A tree step whose read is still to come (SpecStep.run_tree reads it at once; launch
    and launch_after later): every row plain greedy, so nothing but the step's own outputs
    comes back, packed: the accepted path's tokens and verify rows, the accept counts, and the
    next trees' tokens and parents."""

    def __init__(
        self,
        out: SpecOutput,
        b: int,
        padded: int,
        k: int,
        reach: int,  # TreeShape.reach: positions past a row's root that one step writes
        joined: dict[int, ScheduledSeq] | None = None,
    ) -> None:
        super().__init__(out, b, padded, k, joined=joined)
        self._reach = reach

    def _packed(self, packed: Sequence[torch.Tensor]) -> torch.Tensor:
        out = self.out
        parts = [
            out.tokens,
            out.path_rows,
            out.num_accepted[:, None],
            out.drafts,
            out.draft_parents,
        ]
        return torch.cat([p[: self.b] for p in parts], dim=1).reshape(-1)

    @property
    def reach(self) -> int:
        return self._reach

    def read(self, batch: ScheduledBatch) -> StepOutput:
        """The step's output for `batch`: each row's accepted path (tokens, the nodes along
        it) and its next tree (waits for it)."""
        flat = self._host.tolist()  # CPU-GPU sync point: this step's outputs only
        w, n = self.out.tokens.shape[1], self.k  # 1 + S path rows, N nodes
        width = 2 * w + 1 + 2 * n
        tokens, nodes, drafts = [], [], []
        for i in range(self.b):
            row = flat[i * width : (i + 1) * width]
            acc = row[2 * w]
            tokens.append(row[: acc + 1])
            nodes.append([r - 1 for r in row[w + 1 : w + 1 + acc]])
            tail = row[2 * w + 1 :]
            drafts.append(SeqDrafts(tail[:n], tail[n:]))
        return StepOutput(
            [s.request.request_id for s in batch.seqs], tokens, num_accepted=[len(x) for x in nodes],
            accepted_nodes=nodes, next_drafts=drafts,
        )  # fmt: skip
