"""A step's structured-output work, for EngineCore: how a plain step's greedy constrained rows
take their tokens (masked on the device where few, picked from their top logits where many),
whether a step may run ahead on their guesses, and the tokens their grammars force taken at
once (a jump, or a forced run computed by the step run ahead). The grammars themselves, masks,
drafts and rollback, are Grammars' (engine/structured.py); the engine decides when each of
these runs (engine/engine.py) and owns the steps run ahead (engine/overlap.py)."""

from __future__ import annotations

from collections.abc import Container

import torch

from outrider.core import ForwardMode, ScheduledBatch, StepOutput
from outrider.engine import overlap
from outrider.engine.detokenizer import count_until_stop
from outrider.engine.structured import Grammars
from outrider.engine.tracked import TrackedRequest
from outrider.executor.sampler import masked_argmax, masked_argmax_no_sync
from outrider.executor.spec_step import masked_greedy
from outrider.transfer import HostCopy, beside, to_device_no_sync, to_device_packed

# Beside a drafter's aux streams (where a refused guess drops the whole step run ahead), a batch
# with greedy constrained rows runs ahead (on their unmasked argmax) only at these odds or
# better that no grammar refuses its row's guess; the refusal rate is a running average over
# rows with this weight for the newest.
AHEAD_GRAMMAR_ODDS = 0.75
GRAMMAR_MISS_RATE = 0.05
# A plain step run ahead with at most this many greedy constrained rows takes their masked
# argmax on the device before the step after is launched on them (their masks computed on the
# host since the tokens before them were read); more rows run ahead on a guess, their unmasked
# argmax, picked by their grammars from their top logits once read. 64 masks took 1.1-1.4 ms
# on an H200's host, about a step of the default model; 16 take a quarter of it.
MASKS_AHEAD_MAX_ROWS = 16
# A speculative step whose greedy constrained rows verify at most this many rows in all (each
# one's root and drafts) takes their masked argmax on the device, the masks computed on the host
# while the device verifies (Grammars.attach_masks); more are picked from their top logits, read
# between the verify and the drafter (a sync inside the step, the device idle while the host
# walks the grammars). 64 masks took 1.1-1.4 ms on an H200's host; at one stream and k = 4 a
# step verifies 5 rows.
SPEC_MASKS_MAX_ROWS = 32


class GrammarSteps:
    """EngineCore's structured-output work on its steps (the module's docstring). `miss`: how
    often a greedy constrained row's grammar refuses its unmasked argmax, a running average
    over rows."""

    def __init__(
        self,
        grammars: Grammars,
        jumps: bool,  # forced runs taken at once: a plain engine with grammar_drafts on
        max_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.grammars = grammars
        self._jumps = jumps
        self.max_batched_tokens = max_batched_tokens
        self.max_model_len = max_model_len
        self.miss = 0.0

    def guesses_hold(self, batch: ScheduledBatch, aux: bool) -> bool:
        """Whether `batch` may run ahead for its greedy constrained rows: always, unless they run
        ahead on a guess (their unmasked argmax: more than MASKS_AHEAD_MAX_ROWS of them) beside
        a drafter's aux streams (`aux`), whose refusal drops the whole step run ahead; then at
        odds of at least AHEAD_GRAMMAR_ODDS that every guess holds, at the rate their grammars
        have refused argmaxes lately. Without aux streams a refused guess costs its row alone."""
        guesses = sum(s.grammar_topk for s in batch.seqs)
        if not guesses or not aux or self.masks_on_device(batch):
            return True
        return (1.0 - self.miss) ** guesses >= AHEAD_GRAMMAR_ODDS

    def masks_on_device(self, batch: ScheduledBatch) -> bool:
        """Whether a plain step's greedy constrained rows (grammar_topk), once launched ahead
        of its read, take their masked argmax on the device (`mask_on_device`) rather than
        being picked from their top logits: at most MASKS_AHEAD_MAX_ROWS of them."""
        return sum(s.grammar_topk for s in batch.seqs) <= MASKS_AHEAD_MAX_ROWS

    def masks_ahead(
        self, pending: overlap.Pending, batch: ScheduledBatch, redo: dict[int, int]
    ) -> torch.Tensor | None:
        """The masks of a launched plain step's greedy constrained rows, in
        LaunchedGrammar.rows order, from where their grammars stand (each row's position: its
        request's tokens before it are read and followed), where the step takes them on the
        device; None where it does not. Rows in `redo` (dropped at the read) and rows whose
        request ended allow everything."""
        grammar = pending.grammar
        if grammar is None or grammar.candidates is not None:
            return None
        sampling = [s for s in batch.seqs if s.sample]
        rids = [None if r in redo else sampling[r].request.request_id for r in grammar.rows]
        return self.grammars.masks_now(rids)

    def mask_on_device(
        self, pending: overlap.Pending, masks: torch.Tensor | None
    ) -> tuple[torch.Tensor, HostCopy | None]:
        """The launched step's ids with its greedy constrained rows' masked argmax in their
        rows (queued on the device behind the step, before the step after is launched on them),
        and those rows' tokens on their way to the host; the ids as sampled and None without
        masks (`masks_ahead`'s)."""
        if masks is None:
            return pending.device, None
        logits = pending.grammar.logits
        count = len(pending.grammar.rows)
        at, rows, bits = to_device_packed(  # one copy
            [
                (pending.grammar.rows, torch.int64),
                (list(range(count)), torch.int64),
                (masks.numpy(), torch.int32),
            ],
            logits.device,
        )
        picked = masked_argmax_no_sync(logits, rows, bits)
        self.grammars.counters.masked_ahead += count
        return pending.device.index_copy(0, at, picked), HostCopy(picked)

    def attach_masks(self, batch: ScheduledBatch, speculative: bool) -> None:
        """Grammars.attach_masks for a scheduled step: greedy constrained rows are picked from
        their top logits where the step can (a plain step's; a speculative step's past
        SPEC_MASKS_MAX_ROWS verified rows), the rest masked."""
        plain = batch.mode != ForwardMode.VERIFY and not any(s.drafts for s in batch.seqs)
        pick = plain or (speculative and self._mask_rows(batch) > SPEC_MASKS_MAX_ROWS)
        self.grammars.attach_masks(batch, pick=pick)

    def _mask_rows(self, batch: ScheduledBatch) -> int:
        """The rows a speculative step verifies for its greedy constrained sequences: the masks
        it needs to decide them on the device (SPEC_MASKS_MAX_ROWS)."""
        return sum(
            1 + (s.drafts.num_nodes if s.drafts is not None else 0)
            for s in batch.seqs
            if s.sample and masked_greedy(s) and s.request.request_id in self.grammars
        )

    def pick_tokens(
        self,
        batch: ScheduledBatch,
        output: StepOutput,
        skip: Container[int] = (),
        after: torch.cuda.Event | None = None,
    ) -> None:
        """The tokens of a plain step's greedy constrained rows (ScheduledSeq.grammar_topk):
        the argmax among what each grammar allows, from the row's top logits, or where those
        cannot tell, from its mask computed now. skip: rows whose output is dropped. after: in
        a step run ahead, where the step's logits were done; a masked argmax of them is taken
        on a side stream after that alone (transfer.beside), so its read does not wait for the
        step launched since, and the host's work after it overlaps that step."""
        sampling = [s for s in batch.seqs if s.sample]
        # grammar_logits holds the candidates' rows in this order (j). A request that ended in
        # the step before this one, run ahead, has no grammar left: its row is dropped anyway.
        rows = [
            (j, row)
            for j, row in enumerate(output.grammar_candidates)
            if sampling[row].request.request_id in self.grammars and row not in skip
        ]
        if not rows:
            return
        at_rows = [j for j, _ in rows]

        def decide(late: list[tuple[int, int]], masks: torch.Tensor) -> list[int]:
            with beside(after):
                at = [at_rows[i] for i, _ in late]
                at = to_device_no_sync(at, torch.int64, output.grammar_logits.device)
                return masked_argmax(output.grammar_logits.index_select(0, at), masks)

        paths = self.grammars.paths(
            [sampling[row] for _, row in rows],
            [[output.grammar_candidates[row]] for _, row in rows],
            decide,
        )
        for (_, row), ((_, token),) in zip(rows, paths):
            miss = output.token_ids[row] != [token]  # its unmasked argmax, refused
            self.miss += GRAMMAR_MISS_RATE * (miss - self.miss)
            output.token_ids[row] = [token]

    def jumps_alone(self) -> bool:
        """Whether forced runs are taken at once at all: a plain engine (a speculative one
        drafts them instead) with grammar_drafts on."""
        return self._jumps

    def jumps(self, batch: ScheduledBatch) -> set[str]:
        """The constrained requests of `batch` that take the tokens their grammars force at
        once (`jump`, or in a step run ahead `forced_runs`): in a plain engine with
        grammar_drafts on (a speculative one drafts them instead)."""
        if not self.grammars or not self.jumps_alone():
            return set()
        return {s.request.request_id for s in batch.seqs if s.request.request_id in self.grammars}

    def jump(self, tracked: TrackedRequest, start: bool = False) -> tuple[list[int], bool]:
        """The tokens the request's grammar forces after its output (each the only one its
        mask allows, so the masked argmax or a masked draw of any seed), taken by the grammar
        and appended to the output now, cut at a stop token or length; and whether the grammar
        is complete after them. The next step computes them as a chunk and samples after them:
        one forward for a forced run (a key, its quotes, a brace) that took a step a token.
        Not for a request asking for logprobs (a forced token has none of the model). start:
        before the request's first step, which must sample a token: none that ends it."""
        req = tracked.request
        rid = req.request_id
        taken: list[int] = []
        complete = False
        if req.params.logprobs is not None:
            return taken, complete
        while True:  # llguidance lists a run in parts (their ends may join a token)
            forced = self.grammars.forced_tokens(rid)
            n, reason = count_until_stop(req, forced, self.max_model_len)
            if start and reason is not None:
                n -= 1  # the first step samples the last
            if n <= 0:
                break
            complete = self.grammars.advance(rid, forced[:n])
            last = complete or reason is not None
            if start and complete:  # they end the output: the first step samples the last
                self.grammars.rewind(rid, 1)
                n, complete = n - 1, False
            req.output_token_ids.extend(forced[:n])
            taken += forced[:n]
            if last:
                break
        self.grammars.counters.jumped += len(taken)
        return taken, complete

    def forced_runs(self, batch: ScheduledBatch, redo: dict[int, int]) -> dict[int, list[int]]:
        """By row of `batch`: the run its grammar forces from the token the row samples now (that
        token first), where the run goes on past it (`jumps`' rows, not recomputed ones); the
        step run ahead after `batch` computes the run in the row (overlap.next_batch), and once
        `batch` is read the rest of it is output at once (`take_run`), as `jump` takes one in
        a step read before the next. Cut at a stop token or length, and to the scheduler's token
        budget. Read before `batch`'s tokens: its grammars stand before them."""
        rows = self.jumps(batch)
        if not rows:
            return {}
        budget = self.max_batched_tokens - len(batch.seqs)
        runs = {}
        for i, s in enumerate(batch.seqs):
            req = s.request
            if req.request_id not in rows or i in redo or req.is_finished:
                continue
            forced = self.grammars.forced_run(req.request_id, budget + 1)
            if len(forced) < 2:
                continue
            n, _ = count_until_stop(req, forced, self.max_model_len)
            if n < 2 or n - 1 > budget:
                continue
            runs[i] = forced[:n]
            budget -= n - 1
        return runs

    def take_run(self, tracked: TrackedRequest, run: list[int]) -> tuple[list[int], bool]:
        """The rest of the forced run (`forced_runs`) that the step run ahead computes for the
        request, after the token this step gave it: taken by the grammar and output now, as
        `jump` takes a run; and whether the grammar is complete after it."""
        req = tracked.request
        n, _ = count_until_stop(req, run, self.max_model_len)
        taken = run[:n]
        complete = self.grammars.advance(req.request_id, taken)
        req.output_token_ids.extend(taken)
        self.grammars.counters.jumped += len(taken)
        return taken, complete


def with_runs(batch: ScheduledBatch, ids: torch.Tensor) -> torch.Tensor:
    """The input ids of a step run ahead whose forced_run rows compute their runs: those the
    host's, every other row's one token from `ids` (one a row, on the device), in one copy."""
    flat, at, rows, start = [], [], [], 0
    for j, s in enumerate(batch.seqs):
        flat += s.token_ids
        if not s.forced_run:
            at.append(start)
            rows.append(j)
        start += s.query_len
    flat, at, rows = to_device_packed(
        [(flat, torch.int64), (at, torch.int64), (rows, torch.int64)], ids.device
    )
    return flat.index_copy(0, at, ids.index_select(0, rows))
