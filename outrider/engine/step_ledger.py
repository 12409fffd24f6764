"""Where an engine's time goes, by kind of step: how many steps of each kind ran, the seconds
they took (the whole `EngineCore.step` call: schedule, launch, read, bookkeeping), the tokens
they emitted and the rows they computed. A server exports it on /metrics
(`outrider:engine_step_*{kind}`) and `bench serve` reports each point's share, so a loss at
one concurrency can be read as "which steps, how often, how long" without a profiler.

Kinds: "prefill" (a step with prompt chunks, beside decodes or not), "decode" (one token a
row, read before the next step is launched), "decode_ahead" (read while the step after it
already runs: engine/overlap.py), "verify" and "verify_ahead" (a speculative step, the same
two ways). A step that runs ahead costs about its device time; one read before the next is
launched costs its host work on top, and so does the step that follows it.

Cost: one dict update a step (about 1 us)."""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("prefill", "decode", "decode_ahead", "verify", "verify_ahead")


@dataclass
class StepLedger:
    """Totals per kind since the engine started: [steps, seconds, tokens, rows]."""

    totals: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, seconds: float, tokens: int, rows: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown step kind {kind!r}: one of {KINDS}")
        t = self.totals.get(kind)
        if t is None:
            t = self.totals[kind] = [0, 0.0, 0, 0]
        t[0] += 1
        t[1] += seconds
        t[2] += tokens
        t[3] += rows

    def snapshot(self) -> tuple[tuple[str, int, float, int, int], ...]:
        """(kind, steps, seconds, tokens, rows) for every kind that ran, in KINDS' order."""
        return tuple(
            (k, int(t[0]), t[1], int(t[2]), int(t[3]))
            for k in KINDS
            if (t := self.totals.get(k)) is not None
        )
