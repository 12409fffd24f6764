"""Decoding one step ahead (async scheduling): while the device runs step n+1, the host reads
step n's tokens and does its bookkeeping (detokenize, stop checks, the next schedule).

    step n launched ──> launch n+1 with n's sampled ids, still on the device ──> read n's ids
    (host sync; the device is busy with n+1) ──> postprocess n ──> next call: n+1 is launched,
    launch n+2 ...

Step n+1 is the same sequences one position further, so everything but the token values is
known before step n's tokens are read: positions, slots (one more is allocated now), lengths.
What this costs: a request that finishes at step n has one wasted row in step n+1 (ignored,
its KV slot is its own and freed after the write is queued, so stream order keeps it safe);
a request that arrives while a plain step runs ahead joins one step later (no plain step runs
ahead while requests wait).

A plain step runs ahead when every sequence samples one token with no drafts, no logprobs, no
penalties and no active min_tokens (those read output tokens the host does not have yet).
With a proposer, plain steps run ahead while the adaptive controller picks k=0 for the step
after (Speculator.plain_ahead): an n-gram lookup needs nothing from them, and an EAGLE-3
drafter defers their rows from the aux streams the launched step kept (Pending.aux). A step
the controller gives drafts to is scheduled as usual, once the step before it is read.
Greedy constrained sequences run ahead too. Where a step holds at most MASKS_AHEAD_MAX_ROWS of
them (engine/grammar_steps.py), their masks for step n are computed on the host once step n-1's
tokens are followed by their grammars (Grammars.masks_now), and before step n+1 is
launched the device takes their masked argmax of step n's logits into the ids step n+1 reads
(Ahead.masks; GrammarSteps.mask_on_device): nothing is guessed. With more of them, they run
ahead on a guess: step n+1 takes their unmasked argmax of step n, which is the grammar's pick
whenever the grammar allows it. Where it does not, only that row is lost (Ahead.redo): once step
n is read, its grammar picks from step n's top candidates as in a step not run ahead, step n+2
(launched before step n+1 is read) computes the row again at the same position on the picked
token (its KV write replaces step n+1's), and step n+1's output for it is dropped at its read.
At 64 streams a refusal came nearly every step (5% of guesses), and dropping the whole step n+1
for it left the batch running one step at a time. With a drafter that defers rows from the
step's aux streams (EAGLE-3) the whole step n+1 is still dropped.

Forced runs (a plain engine, grammar_drafts on): where a constrained row's grammar, standing
before the token step n samples, forces that token and more after it (a key, its quotes, a
brace), step n+1 computes the whole run in that row, the host's tokens (ScheduledSeq.forced_run,
a mixed step through the PREFILL graphs), and samples after its last; once step n is read the
rest of the run is output at once (GrammarSteps.take_run). Stepped one at a time the run is
computed in one forward after the token before it too (GrammarSteps.jump); run ahead, a run that
follows a token the model chose is known only once that token is read, so its first token
takes a step of its own.

    step n (row A samples `"`, the end of a string; the grammar then forces `, "age": `)
    ─> step n+1 (A computes `"`, samples `,`) ─> read n ─> step n+2 (A computes `, "age": `,
    samples the age) ─> read n+1: `,` and the rest of the run, ` "age": `, output at once

A speculative step runs ahead too, for chains drafted inside the step (EAGLE-3, and n-gram
lookup over the tokens every forward keeps on the device: executor/token_drafts.py) whose rows
are all plain greedy or sample from their parameters alone (spec_step.runs_ahead: no penalties
or grammar; a seeded row's output positions are completed on the device, logprobs come back in
the read; Speculator.launches), and for EAGLE-3 trees whose rows are all plain greedy: step n+1
verifies the k drafts (the tree) step n drafted, from the root after the drafts step n
accepted, all computed on the device (SpecStep.advance_no_sync; a tree's accepted nodes' KV
moved there too), so nothing of it waits for the host. Its positions depend on that acceptance, so every row gets blocks for the
furthest it can reach (3k + 1 past step n's start), and step n's postprocess keeps the 2k
positions past each row's tokens that step n+1 writes (Scheduler.postprocess's hold). It runs at
the same k (the controller is asked first: another pick waits for the step after) and only where
no row can reach the context's end; a request that ends with step n (a stop, max_tokens) leaves
its row of step n+1 unused, as a plain step run ahead does.

Arrivals do not stop speculative steps running ahead (at a server's concurrency one arrives every
few steps). While step n+1 is launched, the prompt chunks of waiting requests (and of running ones
mid-prompt) are launched just before it as a plain forward (Scheduler.schedule_prompts, from the
budget step n+1's rows leave; nobody is preempted) and read after step n, while the device runs
step n+1: a prompt's first token leaves with step n's tokens. Its request then joins step n+2,
launched after step n+1 before that one is read: in the row of a request that finished, or past
the others (a larger captured batch), at its root alone, which the host has; the drafter drafts
its first k inside that step, its draft KV over the prompt caught up just before
(Speculator.launch_after). Requests whose prompt or rows need the host (logprobs of a first token,
penalties, grammars, min_tokens owed: prompt_beside, spec_step.runs_ahead) stop the steps running
ahead, as before.

    step n (rows A B) ─> prompt of C ─> step n+1 (A B) ─> read n, read C's first token
    ─> step n+2 (A B C; or C B when A finished with step n) ─> read n+1 ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from outrider.core import (
    Candidates,
    ForwardMode,
    LaunchedGrammar,
    Request,
    ScheduledBatch,
    ScheduledSeq,
)
from outrider.engine.block_manager import BlockManager
from outrider.executor.sampler import unpack_candidates
from outrider.executor.spec_launch import SpecLaunch
from outrider.executor.spec_step import runs_ahead
from outrider.transfer import HostCopy

PLACEHOLDER = 0  # the token id written into a step's host inputs; the device ids replace it


@dataclass
class Pending:
    """A launched step's sampled ids on their way to the host (transfer.HostCopy): the copy is
    queued right after the step samples them, before the next step is launched, so reading
    them waits for this step alone and the device stays busy with the next while the host
    does the bookkeeping the overlap is for."""

    ids: HostCopy  # [B] int64
    grammar: LaunchedGrammar | None = None  # greedy constrained rows' logits and candidates
    candidates_host: HostCopy | None = None  # grammar.candidates
    aux: torch.Tensor | None = None  # [B, n_aux * hidden] on the device, a drafter's rows

    @classmethod
    def start(
        cls, launched: tuple[torch.Tensor, LaunchedGrammar | None, torch.Tensor | None]
    ) -> Pending:
        """ModelRunner.launch's ids, grammar rows and aux streams; the ids and candidates on
        their way to the host."""
        ids, grammar, aux = launched
        top = None
        if grammar is not None and grammar.candidates is not None:
            top = HostCopy(grammar.candidates)
        return cls(HostCopy(ids), grammar, top, aux)

    @property
    def device(self) -> torch.Tensor:
        """The ids where the step left them."""
        return self.ids.device

    def read(self) -> list[int]:
        """The ids on the host: waits for the step that sampled them (and what ran before it)."""
        return self.ids.tolist()

    def candidates(self) -> dict[int, Candidates] | None:
        """The greedy constrained rows' top candidates (as StepOutput.grammar_candidates), once
        `read` has returned; None without such rows."""
        if self.candidates_host is None:
            return None
        return unpack_candidates(self.candidates_host.wait(), self.grammar.rows)


@dataclass
class Ahead:
    """A launched step whose tokens are not read yet: a plain step (Pending) or a speculative
    one (SpecLaunch)."""

    batch: ScheduledBatch
    token_ids: Pending | SpecLaunch
    # A plain step's rows: the row of the step before it each continues (next_batch's keep).
    continues: list[int] = field(default_factory=list)
    # Rows launched on a guess their grammar refused, by row -> the token it picked instead:
    # their outputs are dropped at the read, and the step after computes them again.
    redo: dict[int, int] = field(default_factory=dict)
    # Its greedy constrained rows' masks on the host (Grammars.masks_now), where their masked
    # argmax is taken on the device before the step after is launched on them.
    masks: torch.Tensor | None = None


def can_run_ahead(batch: ScheduledBatch) -> bool:
    """Whether `batch` can be launched without reading the previous step's tokens, and followed
    by a step launched without reading its own: a decode, or one whose rows of several tokens
    are forced runs (ScheduledSeq.forced_run)."""
    if batch.mode not in (ForwardMode.DECODE, ForwardMode.PREFILL):
        return False
    for s in batch.seqs:
        p = s.request.params
        if not s.sample or s.drafts is not None or (s.query_len != 1 and not s.forced_run):
            return False
        if p.logprobs is not None or p.has_penalties:
            return False
        if p.structured_outputs is not None and not s.grammar_topk:
            return False  # a sampled row's mask needs the token before it on the host
        if len(s.request.output_token_ids) < p.min_tokens:
            return False  # the sampler would count an output one token short
    return True


def prompt_beside(req: Request) -> bool:
    """Whether a request's prompt may be computed beside a speculative step run ahead, its
    first token sampled on the device as a plain step run ahead samples (no logprobs,
    penalties or grammar), and its rows join the steps after it (spec_step.runs_ahead: no
    min_tokens owed)."""
    return req.params.logprobs is None and runs_ahead(req)


def next_batch(
    batch: ScheduledBatch,
    blocks: BlockManager,
    max_model_len: int,
    redo: dict[int, int],
    runs: dict[int, list[int]] | None = None,
) -> tuple[ScheduledBatch, list[int]] | None:
    """The step after `batch` for its unfinished sequences, each past the tokens it computes now
    (a row in `redo` at the same position again, on the token given there; a row in `runs` on
    the forced run given there, whose first token is the one it samples now: a forced_run row),
    and the rows of `batch` they continue; None when a sequence's next slots do not fit (the
    context ends, or the pool is short: no one is preempted for a step run ahead).

    Called before `batch` is postprocessed: num_computed_tokens is still `batch`'s start."""
    runs = runs or {}
    keep = [i for i, s in enumerate(batch.seqs) if not s.request.is_finished]
    if not keep:
        return None
    for i in keep:
        s = batch.seqs[i]
        reach = s.query_len + len(runs.get(i, (PLACEHOLDER,)))
        if s.start_pos + reach > max_model_len or not blocks.allocate(s.request, reach):
            return None
    seqs = []
    for i in keep:
        s = batch.seqs[i]
        if i in redo:
            seqs.append(_again(s, redo[i]))
        else:
            seqs.append(_further(s, runs.get(i)))
    mode = ForwardMode.PREFILL if any(s.forced_run for s in seqs) else ForwardMode.DECODE
    nxt = ScheduledBatch(mode, seqs)
    nxt.grammar_paths = batch.grammar_paths
    return nxt, keep


def _further(s: ScheduledSeq, run: list[int] | None) -> ScheduledSeq:
    # The same sequence's next row, past this one's tokens: its sampled token, still on the
    # device, or the forced run that starts with it, the host's.
    pos, blocks = s.start_pos + s.query_len, s.request.block_ids
    tokens = [PLACEHOLDER] if run is None else list(run)
    return ScheduledSeq(
        s.request, tokens, pos, blocks, True, grammar_topk=s.grammar_topk,
        forced_run=run is not None,
    )  # fmt: skip


def _again(s: ScheduledSeq, token: int) -> ScheduledSeq:
    # The same row once more, on the token its grammar picked (the launch writes it in).
    blocks = s.request.block_ids
    return ScheduledSeq(s.request, [token], s.start_pos, blocks, True, grammar_topk=s.grammar_topk)
