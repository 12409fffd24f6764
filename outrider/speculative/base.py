"""What a proposer hands the engine: draft tokens per sequence, as a chain or a tree.

A chain of k drafts is the degenerate tree whose node i has parent i - 1. Node tokens are in
topological order (a parent before its children); parent -1 is the sequence's last accepted
token (the "root", whose KV is not yet written and which the verify forward computes too).

    chain [a, b, c]:        parents [-1, 0, 1]
    tree  root -> a -> c    parents [-1, -1, 0, 1]    tokens [a, b, c, d]
               -> b -> d
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from outrider.core import Request, ScheduledBatch, StepOutput


@dataclass
class SeqDrafts:
    """One sequence's drafts. Invariant: len(parents) == len(token_ids) and parents[i] < i."""

    token_ids: list[int]
    parents: list[int]
    # [num_nodes, vocab] float32: the distribution node i's token was drawn from (all children
    # of one parent share a row's values). None: deterministic drafts (n-gram lookup), which
    # verification treats as one-hot proposals.
    draft_probs: torch.Tensor | None = None

    @classmethod
    def chain(cls, token_ids: Sequence[int], draft_probs: torch.Tensor | None = None) -> SeqDrafts:
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), draft_probs)

    def truncated(self, n: int) -> SeqDrafts:
        """The first n nodes: still a valid tree, since parents come before children."""
        if n >= self.num_nodes:
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        return SeqDrafts(self.token_ids[:n], self.parents[:n], probs)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


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
