"""Synthetic acceptance: drafts whose acceptance follows a chosen curve, for measuring what
speculation buys on a model that has no trained drafter (random weights of a real shape).

The proposer drafts the target's own greedy continuation, known from a plain run, corrupted
position by position: at each step a request's draft at position i (1-based) is right with
probability a_i given that positions 1..i-1 were right; from the first wrong position on every
draft is wrong (the continuation's token + 1), so greedy chain verification accepts exactly the
leading right run and the accept length follows

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j        (speculative.controller.expected_tokens)

Worked example, k = 4, a = 0.8 everywhere, continuation [.., 17, 40, 9, 23, ..] from the
request's next position: draws u = [0.3, 0.6, 0.85, 0.1] -> right, right, wrong (0.85 >= 0.8),
and everything after -> drafts [17, 40, 10, 24]; the verify accepts 2 and emits the target's
own token at position 3 (9), 3 tokens in all.

Right means equal to the continuation the plain run produced. Where the speculative run's output
leaves that continuation (in bf16 a batched verify can flip a near-tie argmax against one-token
decoding), the continuation's later tokens no longer predict the target; from there the proposer
drafts from a transition table instead: every token of the plain runs (prompts' last tokens
included) mapped to the token that most often followed it, rolled forward from the request's
last output token. On random weights whose layers barely write into the residual stream (what
benchmarks/synthetic_accept.py builds) the next token follows from the current one alone, so the
table predicts the target as the continuation did and one flipped token no longer leaves a
request at accept length 1 for the rest of its run (at C=16 on the 8B shape, 3 such requests
held the batch to 1.03-1.10x while the rest decoded 2-3 tokens a step). A token the table lacks
ends the chain there. Drafts made so are counted in `off_continuation`. Acceptance measured in
the engine is what the benchmark compares; the curve is only its target.

Seeded per request (the seed and the prompt), so a run does not depend on batch composition.
Greedy chains only: these drafts carry no draft distribution (one-hot for a sampled verify).
Not registered by name: the continuations come from a run, not from a config.

The drafts come from the host. For the draft network's cost, `SyntheticDrafter`
(outrider/testing/synthetic_drafter.py) runs a drafter of the target's shape inside the
speculative step and hands its drafts over to this proposer's.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from outrider.core import Request, ScheduledBatch, SeqDrafts, StepOutput


def parse_curve(text: str) -> tuple[float, ...]:
    """ "0.8" -> (0.8,) (every position); "0.9/0.8/0.6" -> per position, the last repeating."""
    try:
        curve = tuple(float(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(
            f"invalid acceptance curve {text!r}: give one rate (0.8) or one per position "
            "separated by '/' (0.9/0.8/0.6)"
        ) from None
    check_curve(curve)
    return curve


def check_curve(curve: Sequence[float]) -> None:
    if not curve or not all(0.0 <= a <= 1.0 for a in curve):
        raise ValueError(f"acceptance curve {list(curve)}: give at least one rate, each in [0, 1]")


def curve_at(curve: Sequence[float], n: int) -> list[float]:
    """Rates for positions 1..n; the last given rate repeats."""
    return [curve[min(i, len(curve) - 1)] for i in range(n)]


def measured_curve(accepted_per_position: Sequence[int], num_verify_steps: int) -> list[float]:
    """Conditional acceptance per position from the engine's counters (stats.record_verify):
    a_1 = accepted at 1 / verifies, a_i = accepted at i / accepted at i - 1. Positions never
    reached (a zero count before them) end the list."""
    out, prev = [], num_verify_steps
    for n in accepted_per_position:
        if prev == 0:
            break
        out.append(n / prev)
        prev = n
    return out


@dataclass
class _Track:
    continuation: list[int]
    rng: random.Random
    checked: int = 0  # output tokens compared with the continuation so far
    diverged: bool = False


@dataclass
class SyntheticCounts:
    """Drafted positions, split by whether the request's output still equals the continuation
    there (only those drafts are right when the curve says so)."""

    on_continuation: int = 0
    off_continuation: int = 0
    diverged_requests: list[str] = field(default_factory=list)


class SyntheticProposer:
    """A host proposer (speculative.base.Proposer) drafting corrupted greedy continuations.

    continuations: prompt token ids -> the target's greedy output for that prompt (a plain run
    with the same max_tokens and EOS ignored). Invariant: one SeqDrafts per request, at most
    `max_draft_tokens` long; a chain; empty when the continuation has nothing past the output.
    """

    name = "synthetic"
    on_device = False
    aux_layers: tuple[int, ...] = ()
    writes_kv = False
    topk = 1
    num_steps = None

    def __init__(
        self,
        continuations: Mapping[tuple[int, ...], Sequence[int]],
        curve: Sequence[float],
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        check_curve(curve)
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size}: a wrong draft needs at least 2 tokens")
        self.continuations = {tuple(p): list(c) for p, c in continuations.items()}
        self.curve, self.vocab_size, self.seed = tuple(curve), vocab_size, seed
        self.counts = SyntheticCounts()
        self._tracks: dict[str, _Track] = {}
        self._next = _transitions(self.continuations)

    def positions_needed(self, k: int) -> int:
        return 1 + k

    def propose(self, requests: Sequence[Request], max_draft_tokens: int) -> list[SeqDrafts]:
        rates = curve_at(self.curve, max_draft_tokens)
        return [self._draft(req, rates) for req in requests]

    def _draft(self, req: Request, rates: list[float]) -> SeqDrafts:
        track = self._track(req)
        out, cont = req.output_token_ids, track.continuation
        n = len(out)
        if not track.diverged and out[track.checked : n] != cont[track.checked : n]:
            track.diverged = True
            self.counts.diverged_requests.append(req.request_id)
        track.checked = n
        if track.diverged:
            right = self._roll(out[-1] if out else req.prompt_token_ids[-1], len(rates))
        else:
            right = cont[n : n + len(rates)]
        drafts, ok = [], True
        for tok, a in zip(right, rates):
            ok = ok and track.rng.random() < a
            drafts.append(tok if ok else (tok + 1) % self.vocab_size)
        if track.diverged:
            self.counts.off_continuation += len(drafts)
        else:
            self.counts.on_continuation += len(drafts)
        return SeqDrafts.chain(drafts)

    def _roll(self, token: int, n: int) -> list[int]:
        """Up to n tokens, each the transition table's successor of the one before."""
        out = []
        while len(out) < n and token in self._next:
            token = self._next[token]
            out.append(token)
        return out

    def _track(self, req: Request) -> _Track:
        track = self._tracks.get(req.request_id)
        if track is None:
            key = tuple(req.prompt_token_ids)
            if key not in self.continuations:
                raise KeyError(
                    f"request {req.request_id!r} has a prompt with no continuation "
                    f"({len(key)} tokens): run it plainly first and pass its output"
                )
            rng = random.Random(f"{self.seed}:{hash(key)}")  # int tuples hash stably
            track = self._tracks[req.request_id] = _Track(self.continuations[key], rng)
        return track

    def observe(self, batch: ScheduledBatch, output: StepOutput) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)


def _transitions(continuations: Mapping[tuple[int, ...], Sequence[int]]) -> dict[int, int]:
    """token -> the token that most often followed it in the plain runs (a prompt's last token
    -> its continuation's first); ties go to the one seen first."""
    seen: dict[int, Counter] = {}
    for prompt, cont in continuations.items():
        run = [*prompt[-1:], *cont]
        for a, b in zip(run, run[1:]):
            seen.setdefault(a, Counter())[b] += 1
    return {a: c.most_common(1)[0][0] for a, c in seen.items()}
