"""The proposer protocol. What a proposer hands the engine, draft tokens per sequence as a chain
or a tree (`SeqDrafts`), is plain data in outrider/core.py, drawn there; it is re-exported here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from outrider.core import Request, ScheduledBatch, SeqDrafts, StepOutput

__all__ = ["Proposer", "SeqDrafts"]


class Proposer(Protocol):
    """Drafts tokens for running requests. Implementations are registered by name in
    `outrider.engine.proposers`; a new drafter adds a file, not branches.

    Two kinds, told apart by `on_device`:
    - host proposers (n-gram) draft in `propose` before a step, from the requests' tokens;
    - device drafters (EAGLE-3, a network the runner owns) draft inside the speculative step
      right after verifying (their next drafts come back in StepOutput.next_drafts); `propose`
      serves the steps that are not speculative steps (prefill, trees).

    Invariant: `propose` returns one entry per request, in order; an entry may be empty (no
    drafts this step), and its length never exceeds `max_draft_tokens`.
    """

    name: str
    on_device: bool  # drafts inside the speculative step (needs the target's aux streams)
    aux_layers: tuple[int, ...]  # target layers whose input streams it reads; () for none
    writes_kv: bool  # writes its own KV in the slots past a request's computed tokens
    topk: int  # 1 drafts chains; > 1 trees (not a speculative-step shape yet)

    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]: ...

    def observe(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Called after every step's postprocess with what the target just computed (drafters
        that follow the target's features catch up here; others do nothing)."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop per-request state; the engine calls it when a request finishes or aborts."""
        ...

    def positions_needed(self, k: int) -> int:
        """Slots from a request's root position that proposing k drafts and verifying them
        use (1 + k for drafts that write no KV)."""
        ...
