"""EngineCore.step(): schedule -> execute -> postprocess. CPU bookkeeping lives here, in the
scheduler and in the speculator (engine/speculation.py); the model runner owns every tensor."""

from __future__ import annotations

import time
import weakref

import torch

from outrider import env
from outrider.config import EngineConfig
from outrider.core import (
    FinishReason,
    ForwardMode,
    Request,
    RequestOutput,
    SamplingParams,
    ScheduledBatch,
    StepOutput,
)
from outrider.engine import overlap, stop_strings
from outrider.engine.block_manager import BlockManager
from outrider.engine.detokenizer import IncrementalDetokenizer, check_stop
from outrider.engine.grammar_steps import GrammarSteps, with_runs
from outrider.engine.limits import ContextLimit, check_request, context_limit
from outrider.engine.proposers import build_proposer, check_method
from outrider.engine.scheduler import Scheduler
from outrider.engine.speculation import Speculator
from outrider.engine.step_ledger import StepLedger
from outrider.engine.structured import Grammars
from outrider.engine.tracked import TrackedRequest
from outrider.executor import tp_workers
from outrider.executor.model_runner import ModelRunner
from outrider.executor.sampler import make_generator
from outrider.executor.spec_launch import SpecLaunch
from outrider.executor.spec_step import runs_ahead
from outrider.loaders.checkpoint import Checkpoint, open_checkpoint
from outrider.loaders.hf_config import check_tp_size
from outrider.transfer import to_device_no_sync, to_device_packed


class EngineCore:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        if env.num_threads() > 0:
            torch.set_num_threads(env.num_threads())
        check_method(config.speculative.method)  # before the model loads
        self.config = config
        self.checkpoint = checkpoint or open_checkpoint(config.model.model or env.default_model())
        self.tokenizer = self.checkpoint.tokenizer
        self.runner = self._start_runner(config)
        # Before the block manager: a drafter's KV pool takes its share of the budget from the
        # target's (ModelRunner.make_room_for).
        proposer = build_proposer(config.speculative, self.runner, self.checkpoint)
        # Within the KV pool, so check_stop's context limit also keeps every request in it.
        self.context = context_limit(self.runner, config)
        self.max_model_len = self.context.tokens
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.runner.hand_out_kv()
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, self.max_model_len, self.runner.device.type
        )
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.checkpoint.config.eos_token_ids
        )
        self.vocab_size = self.checkpoint.config.vocab_size
        self._tracked: dict[str, TrackedRequest] = {}
        # Constrained requests' grammars (engine/structured.py): masks, drafts, finishing.
        self.grammars = Grammars(
            self.tokenizer, self.vocab_size, pinned=self.runner.device.type == "cuda"
        )
        # Async scheduling (engine/overlap.py): on CUDA unless asked otherwise; with a proposer,
        # for plain steps its controller keeps plain (Speculator.plain_ahead).
        overlap_on = config.scheduler.async_scheduling
        if overlap_on is None:
            overlap_on = self.runner.device.type == "cuda"
        self._async_asked = bool(overlap_on)
        self._ahead: overlap.Ahead | None = None
        # A speculative step's decoding rows, run in the call after its prompt chunks.
        self._decodes_next: ScheduledBatch | None = None
        self.num_steps_run_ahead = 0
        self.ledger = StepLedger()  # steps by kind: count, seconds, tokens, rows
        self._kind: str | None = None
        self._rows = 0
        # Steps run ahead on a greedy constrained row's unmasked argmax that its grammar then
        # refused: dropped whole (beside a drafter's aux streams), or only the refused rows
        # computed again (Ahead.redo).
        self.num_steps_run_ahead_dropped = 0
        self.num_rows_run_ahead_redone = 0
        self.speculator = Speculator(
            config.speculative, self.runner, self.block_manager, self.max_model_len, proposer,
            self.grammars, ahead=self._async_asked,
        )  # fmt: skip
        self.grammar_steps = GrammarSteps(
            self.grammars, proposer is None and config.speculative.grammar_drafts,
            config.scheduler.max_num_batched_tokens, self.max_model_len,
        )  # fmt: skip

    def _start_runner(self, config: EngineConfig) -> ModelRunner:
        """The model runner, on one rank or as rank 0 of a tensor-parallel group (the other
        ranks started here, or by torchrun). Under torchrun a rank > 0 never returns: it
        follows rank 0's steps, then ends its process when rank 0 stops (exit code 0, through
        tp_workers.leave_process)."""
        size = config.parallel.tensor_parallel_size
        if size == 1:
            self._ranks = None
            return ModelRunner(config, self.checkpoint)
        check_tp_size(self.checkpoint.config, size)  # before any process starts
        ranks = tp_workers.start_ranks(config, str(self.checkpoint.path))
        if ranks.tp.rank > 0:
            try:
                tp_workers.run_worker(config, self.checkpoint, ranks.tp)
            finally:
                ranks.close()
            tp_workers.leave_process(0)
        if ranks.procs and tp_workers.rank_device(config, 0).type == "cpu":
            torch.set_num_threads(tp_workers.cpu_threads(size))
        self._ranks = ranks
        try:
            runner = ModelRunner(config, self.checkpoint, tp=ranks.tp)
        except Exception as e:
            died = ranks.explain(e)
            ranks.close()
            if died is not None:
                raise died from e
            raise
        # Closed when the engine is (shutdown(), garbage, interpreter exit): the other ranks
        # leave their loop and torch.distributed ends, so another engine may start.
        self._finalizer = weakref.finalize(self, ranks.close, runner)
        # Steps that fail in a collective say which rank died (one rank keeps step() as is).
        self.step = self._step_checked
        return runner

    def shutdown(self) -> None:
        """Release what the engine holds outside this process: the other tensor-parallel
        ranks (they exit). Nothing to do on one rank."""
        if self._ranks is not None:
            self._finalizer()

    def _step_checked(self) -> list[RequestOutput]:
        """step() under tensor parallelism: a collective that fails because a rank died raises
        RankDied naming it, and the other ranks are ended."""
        if self._ranks.failure is not None:
            raise tp_workers.RankDied(self._ranks.failure)
        try:
            return EngineCore.step(self)
        except RuntimeError as e:
            died = None if isinstance(e, tp_workers.RankDied) else self._ranks.explain(e)
            if died is not None:
                raise died from e
            raise

    # -- requests ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem; the engine's state is untouched either way (a
        constraint that compiles, and the stop strings' automaton, are cached for the request
        that follows: the server validates off the engine thread)."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.context, self.grammars)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> Request:
        self.validate(prompt_token_ids, params)
        req = Request(
            prompt_token_ids=list(prompt_token_ids), params=params, eos_token_ids=self.eos_token_ids
        )
        if request_id is not None:
            if request_id in self._tracked:
                raise ValueError(f"request id {request_id!r} is already in use: pass a unique id")
            req.request_id = request_id
        if params.seed is not None:
            req.generator = make_generator(params.seed, self.runner.device)
        if params.structured_outputs is not None:
            self.grammars.start(req.request_id, params.structured_outputs)
        tracked = TrackedRequest(req, IncrementalDetokenizer(self.tokenizer, req), prompt)
        self._tracked[req.request_id] = tracked
        if params.structured_outputs is not None and self.grammar_steps.jumps_alone():
            # What the grammar forces first (an object's opening and first key) is computed
            # with the prompt, and the first token sampled after it.
            tracked.pending = self.grammar_steps.jump(tracked, start=True)[0]
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._tracked.pop(request_id, None)
        self.speculator.forget(request_id)
        self.grammars.forget(request_id)

    @property
    def _async(self) -> bool:
        """Whether plain decode steps run ahead (with a proposer, those its controller keeps
        plain: `_run_ahead`)."""
        return self._async_asked

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return a delta (new text and token ids) per request that advanced.

        With async scheduling, a plain decode step launches the next one before reading its
        own tokens (engine/overlap.py): that step is then taken here instead of a new schedule.
        Each step is entered in `ledger` by its kind (engine/step_ledger.py). Autograd is off
        for all of it: the device work the engine queues itself (a step run ahead's masked
        argmax) takes the fused kernels, which serve only without it (fused.use_fused)."""
        t0 = time.perf_counter()
        self._kind, self._rows = None, 0
        with torch.no_grad():
            deltas = self._step(t0)
        if self._kind is not None:
            kind = self._kind
            if kind != "prefill" and self._ahead is not None:
                kind += "_ahead"  # the step after it was launched before this one was read
            tokens = sum(len(d.token_ids) for d in deltas)
            self.ledger.add(kind, time.perf_counter() - t0, tokens, self._rows)
        return deltas

    def _label(self, kind: str, batch: ScheduledBatch) -> None:
        """What this step is, for the ledger (its "_ahead" form is decided at its end)."""
        self._kind, self._rows = kind, len(batch.seqs)

    def _step(self, t0: float) -> list[RequestOutput]:
        decodes, self._decodes_next = self._decodes_next, None
        if decodes is not None:
            decodes = self.speculator.rows_left(decodes)
        redo: dict[int, int] = {}  # rows launched on a refused guess (overlap.Ahead.redo)
        masks = None  # greedy constrained rows' masks for the device (GrammarSteps.masks_ahead)
        if self._ahead is not None:
            batch, ids, redo = self._ahead.batch, self._ahead.token_ids, self._ahead.redo
            masks = self._ahead.masks
            self._ahead = None
            if isinstance(ids, SpecLaunch):
                return self._speculate_ahead(batch, ids, t0)
            self._label("decode", batch)
        elif decodes is not None:  # a speculative step whose prompt chunks ran before it
            return self._speculate(decodes, t0)
        else:
            max_drafts, lookahead = self.speculator.before_schedule(
                self.scheduler.running, waiting=self.scheduler.num_waiting > 0
            )
            batch = self.scheduler.schedule(max_drafts=max_drafts, lookahead=lookahead)
            if batch.is_empty:
                return []
            speculative = self.speculator.is_speculative_step(batch)
            if self.grammars:
                self.grammar_steps.attach_masks(batch, speculative)
            if speculative and batch.mode == ForwardMode.PREFILL:
                return self._prompts_first(batch, t0)
            if speculative:
                return self._speculate(batch, t0)
            self._label("prefill" if batch.mode == ForwardMode.PREFILL else "decode", batch)
            if not (self._async and self._can_run_ahead(batch)):
                output = self.runner.run(batch)
                if output.grammar_candidates:
                    self.grammar_steps.pick_tokens(batch, output)
                deltas = self._advance(batch, output)
                self.speculator.record_step(batch, False, t0)
                return deltas
            launched = self.runner.launch(
                batch, candidates=not self.grammar_steps.masks_on_device(batch)
            )
            ids = overlap.Pending.start(launched)
        if masks is None:  # (while the device runs the step)
            masks = self.grammar_steps.masks_ahead(ids, batch, redo)
        on_device, masked = self.grammar_steps.mask_on_device(ids, masks)
        self._ahead = self._run_ahead(batch, on_device, redo)
        tokens = ids.read()  # CPU-GPU sync point (the device is busy with the step run ahead)
        if masked is not None:  # greedy constrained rows: the masked argmax, as launched on
            for row, token in zip(ids.grammar.rows, masked.tolist()):
                tokens[row] = token
        rids = [s.request.request_id for s in batch.seqs]
        output = StepOutput(rids, [[t] for t in tokens], aux_hidden=ids.aux)
        if ids.grammar is not None and masked is None:  # their grammars pick now
            output.grammar_candidates = ids.candidates()
            output.grammar_logits = ids.grammar.logits
            self.grammar_steps.pick_tokens(batch, output, skip=redo, after=ids.ids.event)
            refused = {
                r: output.token_ids[r][0]
                for r in ids.grammar.rows
                if r not in redo and output.token_ids[r] != [tokens[r]]
            }
            if refused and self._ahead is not None:  # it ran on tokens a grammar refused
                self._redo_or_drop(refused)
        if redo:  # rows computed on a refused guess: the step run ahead computes them again
            live = [i for i in range(len(batch.seqs)) if i not in redo]
            batch = ScheduledBatch(batch.mode, [batch.seqs[i] for i in live])
            output = StepOutput([rids[i] for i in live], [output.token_ids[i] for i in live])
        hold = 0  # a forced run the step run ahead computes reaches past this step's tokens
        if self._ahead is not None:
            hold = max((s.query_len - 1 for s in self._ahead.batch.seqs if s.forced_run), default=0)
        deltas = self._advance(batch, output, hold)
        if self._ahead is not None and all(s.request.is_finished for s in self._ahead.batch.seqs):
            # Every row it continues finished with this step: nothing of it is wanted (its KV
            # writes land in finished requests' slots before anything launched later). Kept,
            # the next run's first step would take it, a proposer given since included.
            self._ahead = None
        if self._ahead is not None:  # its rows' grammars have followed this step's tokens
            ahead = self._ahead
            ahead.masks = self.grammar_steps.masks_ahead(ahead.token_ids, ahead.batch, ahead.redo)
        self.speculator.record_step(batch, False, t0)  # the period of a step run ahead
        return deltas

    def _speculate(self, batch: ScheduledBatch, t0: float) -> list[RequestOutput]:
        """A speculative step over decoding rows: launched ahead of its read where it can be
        (Speculator.launches), else run and read."""
        self._label("verify", batch)
        if self._async and self.speculator.launches(batch):
            return self._speculate_ahead(batch, self.speculator.launch(batch), t0)
        output = self.speculator.run(batch)
        deltas = self._advance(batch, output)
        self.speculator.record_step(batch, True, t0)
        return deltas

    def _prompts_first(self, batch: ScheduledBatch, t0: float) -> list[RequestOutput]:
        """A speculative step with prompt chunks beside its decoding rows: the chunks run first,
        as a plain forward whose first tokens leave now, and the decoding rows in the next
        call, as the speculative step (`_decodes_next`). Together the two took one call, so a
        prompt's first token waited for the speculative step's drafting and verify too (at a
        server's concurrency an arrival lands in such a step nearly every time)."""
        prompts, decodes = self.speculator.split(batch)
        self._label("prefill", prompts)
        output = self.runner.run(prompts)
        if output.grammar_candidates:
            self.grammar_steps.pick_tokens(prompts, output)
        self._decodes_next = decodes
        deltas = self._advance(prompts, output)
        self.speculator.record_prompts(decodes, t0)
        return deltas

    def _speculate_ahead(
        self, batch: ScheduledBatch, launched: SpecLaunch, t0: float
    ) -> list[RequestOutput]:
        """A speculative step launched without its read: prompt chunks, and the step after it
        on its outputs still on the device, are launched behind it (where they can be), then
        this one is read and postprocessed while the device runs those, then the chunks.
        Requests whose first token such chunks sampled join the step launched after the next
        read (engine/overlap.py)."""
        self._label("verify", batch)
        nxt = beside = None
        joins = self._joins(batch)
        if joins is not None:
            beside = self._prompts_beside(batch, launched.k)  # first: read before nxt ends
            nxt = self.speculator.launch_after(batch, launched, joins)
        output = self.speculator.read(batch, launched)  # CPU-GPU sync point
        # The blocks the step run ahead writes in stay with their requests.
        deltas = self._advance(batch, output, hold=nxt.reach if nxt is not None else 0)
        if beside is not None:
            prompts, ids = beside
            rids = [s.request.request_id for s in prompts.seqs if s.sample]
            tokens = ids.read()  # CPU-GPU sync point (the step after this one runs on)
            deltas += self._advance(
                prompts, StepOutput(rids, [[t] for t in tokens], aux_hidden=ids.aux)
            )
        if nxt is not None:
            after = self.speculator.batch_after(batch, output, nxt)
            if any(not s.request.is_finished for s in after.seqs):
                self._ahead = overlap.Ahead(after, nxt)
                self.num_steps_run_ahead += 1
        if beside is None:  # (a step with prompt chunks beside is none of k's: record_step)
            self.speculator.record_step(batch, True, t0)
        return deltas

    def _joins(self, batch: ScheduledBatch) -> list[Request] | None:
        """Whether a speculative step may follow `batch` before `batch` is read, and the
        requests that join it (their rows the host's): None unless every running request not
        in `batch` is decoding and may run ahead (spec_step.runs_ahead), or computes a prompt
        chunk beside it, as any waiting one may (overlap.prompt_beside)."""
        rows = {s.request.request_id for s in batch.seqs if not s.request.is_finished}
        joins = []
        for req in self.scheduler.running:
            if req.request_id in rows:
                continue
            if req.num_tokens - req.num_computed_tokens > 1:  # a prompt, chunks to come
                if not overlap.prompt_beside(req):
                    return None
            elif runs_ahead(req):
                joins.append(req)
            else:
                return None
        if not all(overlap.prompt_beside(r) for r in self.scheduler.waiting):
            return None
        return joins

    def _prompts_beside(
        self, batch: ScheduledBatch, k: int
    ) -> tuple[ScheduledBatch, overlap.Pending] | None:
        """The prompt chunks to compute beside the step after `batch` (Scheduler.
        schedule_prompts, from the budget its rows leave), launched now; None without any."""
        sched = self.scheduler
        if not sched.num_waiting and all(
            r.num_tokens - r.num_computed_tokens <= 1 for r in sched.running
        ):
            return None
        rows = sum(not s.request.is_finished for s in batch.seqs)
        prompts = sched.schedule_prompts(sched.config.max_num_batched_tokens - rows * (1 + k))
        if prompts.is_empty:
            return None
        return prompts, overlap.Pending.start(self.runner.launch(prompts))

    def _can_run_ahead(self, batch: ScheduledBatch) -> bool:
        """overlap.can_run_ahead, and where its greedy constrained rows would run ahead on
        guesses, odds that they hold (GrammarSteps.guesses_hold)."""
        return overlap.can_run_ahead(batch) and self.grammar_steps.guesses_hold(
            batch, aux=bool(self.runner.aux_layers)
        )

    def _redo_or_drop(self, refused: dict[int, int]) -> None:
        """The step run ahead was launched on guesses the grammars refused, by row of the step
        just read -> the token picked instead: those rows are computed again by the step after
        it (overlap.Ahead.redo). Where a drafter defers the step's rows from its aux streams,
        the whole step is dropped instead (its KV writes are rewritten by the step that
        replaces it)."""
        ahead = self._ahead
        if ahead.token_ids.aux is not None:
            self._ahead = None
            self.num_steps_run_ahead_dropped += 1
            return
        at = {row: j for j, row in enumerate(ahead.continues)}
        for row, token in refused.items():
            if row not in at:  # (a request that ended with the step read has no row there)
                continue
            seq = ahead.batch.seqs[at[row]]
            if seq.forced_run:  # launched on its forced run, the host's: the grammar's pick
                if seq.token_ids[0] != token:  # (a pick off its own forced run: never)
                    self._ahead = None
                    self.num_steps_run_ahead_dropped += 1
                    return
                continue
            ahead.redo[at[row]] = token
            self.num_rows_run_ahead_redone += 1

    def _may_follow(self, batch: ScheduledBatch) -> bool:
        """Whether a step over `batch`'s rows may be launched after it before it is read: no
        request waits to be scheduled, and none running is left out (a long prefill given no
        budget would be left out of every step run ahead after it too)."""
        if self.scheduler.num_waiting:
            return False
        return self.scheduler.num_running <= sum(not s.request.is_finished for s in batch.seqs)

    def _run_ahead(
        self, batch: ScheduledBatch, ids: torch.Tensor, redo: dict[int, int]
    ) -> overlap.Ahead | None:
        """Launch the decode after `batch` on its sampled ids, still on the device (rows in
        `redo` again, on the tokens given there); None when requests wait to be scheduled or
        the step cannot run ahead."""
        if not self._may_follow(batch) or not self._can_run_ahead(batch):
            return None
        if not self.speculator.plain_ahead(batch):  # the controller gives the next step drafts
            return None
        runs = self.grammar_steps.forced_runs(batch, redo)
        nxt = overlap.next_batch(batch, self.block_manager, self.max_model_len, redo, runs)
        if nxt is None:
            return None
        next_batch, keep = nxt
        if len(keep) != len(batch.seqs):
            # (a pageable copy would wait for the step in flight: no overlap)
            ids = ids.index_select(0, to_device_no_sync(keep, torch.int64, ids.device))
        again = [(j, redo[i]) for j, i in enumerate(keep) if i in redo]
        if again:
            at, tokens = to_device_packed(
                [([j for j, _ in again], torch.int64), ([t for _, t in again], torch.int64)],
                ids.device,
            )
            ids = ids.index_copy(0, at, tokens)
        if runs:
            ids = with_runs(next_batch, ids)
        self.num_steps_run_ahead += 1
        candidates = not self.grammar_steps.masks_on_device(next_batch)
        launched = overlap.Pending.start(self.runner.launch(next_batch, ids, candidates))
        return overlap.Ahead(next_batch, launched, continues=keep)

    def _advance(
        self, batch: ScheduledBatch, output: StepOutput, hold: int = 0
    ) -> list[RequestOutput]:
        """Everything after the forward: stops inside accepted runs, the scheduler's and the
        drafter's bookkeeping, detokenizing, finishing, the next drafts. hold: positions past
        each request's tokens whose blocks it keeps (a step launched ahead writes there)."""
        self.speculator.trim_output(batch, output)
        self.scheduler.postprocess(batch, output, hold)
        # The grammars follow the step's tokens first: the next drafts are cut to, and led by,
        # what each allows after them. True: the grammar allows no more.
        complete = {}
        if self.grammars:  # any constrained request
            complete = {
                rid: self.grammars.advance(rid, new_ids)
                for rid, new_ids in zip(output.request_ids, output.token_ids)
                if rid in self._tracked
            }
        self.speculator.after_postprocess(batch, output)
        deltas = []
        jumps = self.grammar_steps.jumps(batch)
        runs: dict[str, list[int]] = {}  # rid -> the forced run the step run ahead computes
        if self._ahead is not None:  # rows a step launched before this read continues: no jump
            seqs = self._ahead.batch.seqs
            runs = {s.request.request_id: s.token_ids[1:] for s in seqs if s.forced_run}
            jumps = jumps.difference(s.request.request_id for s in seqs)
        for rid, new_ids in zip(output.request_ids, output.token_ids):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue  # aborted while the step ran
            req = tracked.request
            if tracked.pending:  # forced before its first step, which it leads
                new_ids, tracked.pending = [*tracked.pending, *new_ids], []
            text, new_ids = tracked.detokenize(new_ids)
            reason = self._stop(tracked, complete.get(rid, False))
            if reason is None and (rid in jumps or rid in runs):
                if rid in runs:
                    forced, complete_now = self.grammar_steps.take_run(tracked, runs[rid])
                else:
                    forced, complete_now = self.grammar_steps.jump(tracked)
                if forced:
                    more, forced = tracked.detokenize(forced)
                    text, new_ids = text + more, [*new_ids, *forced]
                    reason = self._stop(tracked, complete_now)
            if reason is not None:
                self.scheduler.finish(req, reason)
                if req.params.detokenize:
                    text += tracked.detokenizer.flush()  # text held back as a stop string
                del self._tracked[rid]
                self.speculator.forget(rid)
                self.grammars.forget(rid)
            deltas.append(tracked.output(text, new_ids))
        self.speculator.after_step(self.scheduler.running)
        return deltas

    def _stop(self, tracked: TrackedRequest, complete: bool) -> FinishReason | None:
        """Why the request ends after its output so far (a stop string, its grammar complete,
        a stop token, a length), or None."""
        if tracked.detokenizer.stop_hit or complete:
            return FinishReason.STOP
        return check_stop(tracked.request, self.max_model_len)


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    context: ContextLimit,
    grammars: Grammars | None,
) -> None:
    """EngineCore.validate on what it reads, for a process that holds a copy of it (the server's,
    beside an engine process): ValueError naming the problem. A constraint that compiles is
    cached in `grammars`, and the stop strings' automaton, for the request that follows."""
    check_request(prompt_token_ids, params, vocab_size, context)
    if params.structured_outputs is not None:
        grammars.compile(params.structured_outputs)
    if params.stop:
        stop_strings.automaton(params.stop)
