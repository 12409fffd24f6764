"""Acceptance statistics: per request (on RequestMetrics) and for the engine as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.core import RequestMetrics


def record_verify(metrics: RequestMetrics | SpecStats, num_drafts: int, num_accepted: int) -> None:
    """One verify step of one sequence: num_drafts proposed, the first num_accepted of the
    accepted path kept (depth d accepted means every depth < d was too)."""
    metrics.num_draft_tokens += num_drafts
    metrics.num_accepted_tokens += num_accepted
    metrics.num_verify_steps += 1
    per_pos = metrics.accepted_per_position
    if len(per_pos) < num_drafts:
        per_pos.extend([0] * (num_drafts - len(per_pos)))
    for d in range(num_accepted):
        per_pos[d] += 1


def accept_length(num_accepted: int, num_verify_steps: int) -> float | None:
    """Tokens produced per verify step per sequence, the bonus/correction token included."""
    return None if num_verify_steps == 0 else 1 + num_accepted / num_verify_steps


@dataclass
class SpecStats:
    """Engine-wide counters (finished and running requests alike)."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Drafts a constrained request's grammar forced (engine/structured.py), among the drafts.
    num_forced_drafts: int = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        record_verify(self, num_drafts, num_accepted)  # same fields, same arithmetic

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.num_accepted_tokens, self.num_verify_steps)

    @property
    def acceptance_rate(self) -> float | None:
        return (
            None if self.num_draft_tokens == 0 else self.num_accepted_tokens / self.num_draft_tokens
        )
