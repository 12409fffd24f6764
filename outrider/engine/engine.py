"""EngineCore.step(): schedule -> execute -> postprocess. CPU bookkeeping lives here, in the
scheduler and in the speculator (engine/speculation.py); the model runner owns every tensor."""

from __future__ import annotations

import time
import weakref
from collections.abc import Container

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
from outrider.engine.detokenizer import IncrementalDetokenizer, check_stop, count_until_stop
from outrider.engine.limits import ContextLimit, check_request, context_limit
from outrider.engine.proposers import build_proposer, check_method
from outrider.engine.scheduler import Scheduler
from outrider.engine.speculation import Speculator
from outrider.engine.step_ledger import StepLedger
from outrider.engine.structured import Grammars
from outrider.engine.tracked import TrackedRequest
from outrider.executor import tp_workers
from outrider.executor.model_runner import ModelRunner
from outrider.executor.sampler import make_generator, masked_argmax, masked_argmax_no_sync
from outrider.executor.spec_launch import SpecLaunch
from outrider.executor.spec_step import masked_greedy, runs_ahead
from outrider.loaders.checkpoint import Checkpoint, open_checkpoint
from outrider.loaders.hf_config import check_tp_size
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
# on an H200's host, about a step of the default model; 16 take a quarter of it, in a thread.
MASKS_AHEAD_MAX_ROWS = 16
# A speculative step whose greedy constrained rows verify at most this many rows in all (each
# one's root and drafts) takes their masked argmax on the device, the masks computed on the host
# while the device verifies (Grammars.attach_masks); more are picked from their top logits, read
# between the verify and the drafter (a sync inside the step, the device idle while the host
# walks the grammars). 64 masks took 1.1-1.4 ms on an H200's host; at one stream and k = 4 a
# step verifies 5 rows.
SPEC_MASKS_MAX_ROWS = 32


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
        # computed again (Ahead.redo); and how often a constrained row's grammar refuses its
        # argmax (a running average over rows): beside aux streams a batch runs ahead only
        # while that seems unlikely.
        self.num_steps_run_ahead_dropped = 0
        self.num_rows_run_ahead_redone = 0
        self._grammar_miss = 0.0
        self.speculator = Speculator(
            config.speculative, self.runner, self.block_manager, self.max_model_len, proposer,
            self.grammars, ahead=self._async_asked,
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
        if params.structured_outputs is not None and self._jumps_alone():
            # What the grammar forces first (an object's opening and first key) is computed
            # with the prompt, and the first token sampled after it.
            tracked.pending = self._jump(tracked, start=True)[0]
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
        masks = None  # greedy constrained rows' masks, taken on the device (_masks_ahead)
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
            if self.grammars:  # greedy rows picked from their top logits where the step can
                plain = batch.mode != ForwardMode.VERIFY and not any(s.drafts for s in batch.seqs)
                pick = plain or (speculative and self._mask_rows(batch) > SPEC_MASKS_MAX_ROWS)
                self.grammars.attach_masks(batch, pick=pick)
            if speculative and batch.mode == ForwardMode.PREFILL:
                return self._prompts_first(batch, t0)
            if speculative:
                return self._speculate(batch, t0)
            self._label("prefill" if batch.mode == ForwardMode.PREFILL else "decode", batch)
            if not (self._async and self._can_run_ahead(batch)):
                output = self.runner.run(batch)
                if output.grammar_candidates:
                    self._pick_grammar_tokens(batch, output)
                deltas = self._advance(batch, output)
                self.speculator.record_step(batch, False, t0)
                return deltas
            launched = self.runner.launch(batch, candidates=not self._masks_on_device(batch))
            ids = overlap.Pending.start(launched)
        if masks is None:  # (while the device runs the step)
            masks = self._masks_ahead(ids, batch, redo)
        on_device, masked = self._mask_on_device(ids, masks)
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
            self._pick_grammar_tokens(batch, output, skip=redo, after=ids.ids.event)
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
            ahead.masks = self._masks_ahead(ahead.token_ids, ahead.batch, ahead.redo)
        self.speculator.record_step(batch, False, t0)  # the period of a step run ahead
        return deltas

    def _mask_rows(self, batch: ScheduledBatch) -> int:
        """The rows a speculative step verifies for its greedy constrained sequences: the masks
        it needs to decide them on the device (SPEC_MASKS_MAX_ROWS)."""
        return sum(
            1 + (s.drafts.num_nodes if s.drafts is not None else 0)
            for s in batch.seqs
            if s.sample and masked_greedy(s) and s.request.request_id in self.grammars
        )

    def _masks_on_device(self, batch: ScheduledBatch) -> bool:
        """Whether a plain step's greedy constrained rows (grammar_topk), once launched ahead
        of its read, take their masked argmax on the device (`_mask_on_device`) rather than
        being picked from their top logits: at most MASKS_AHEAD_MAX_ROWS of them."""
        return sum(s.grammar_topk for s in batch.seqs) <= MASKS_AHEAD_MAX_ROWS

    def _masks_ahead(
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

    def _mask_on_device(
        self, pending: overlap.Pending, masks: torch.Tensor | None
    ) -> tuple[torch.Tensor, HostCopy | None]:
        """The launched step's ids with its greedy constrained rows' masked argmax in their
        rows (queued on the device behind the step, before the step after is launched on them),
        and those rows' tokens on their way to the host; the ids as sampled and None without
        masks (`_masks_ahead`'s)."""
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
            self._pick_grammar_tokens(prompts, output)
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

    def _pick_grammar_tokens(
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
            self._grammar_miss += GRAMMAR_MISS_RATE * (miss - self._grammar_miss)
            output.token_ids[row] = [token]

    def _can_run_ahead(self, batch: ScheduledBatch) -> bool:
        """overlap.can_run_ahead, and for greedy constrained rows run ahead on a guess (their
        unmasked argmax: more than MASKS_AHEAD_MAX_ROWS of them) beside a drafter's aux
        streams, whose refusal drops the whole step run ahead (`_redo_or_drop`), odds of at
        least AHEAD_GRAMMAR_ODDS that every guess holds, at the rate their grammars have
        refused argmaxes lately. Without them a refused guess costs its row alone."""
        if not overlap.can_run_ahead(batch):
            return False
        guesses = sum(s.grammar_topk for s in batch.seqs)
        if not guesses or not self.runner.aux_layers or self._masks_on_device(batch):
            return True
        return (1.0 - self._grammar_miss) ** guesses >= AHEAD_GRAMMAR_ODDS

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
        runs = self._forced_runs(batch, redo)
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
            ids = _with_runs(next_batch, ids)
        self.num_steps_run_ahead += 1
        candidates = not self._masks_on_device(next_batch)
        launched = overlap.Pending.start(self.runner.launch(next_batch, ids, candidates))
        return overlap.Ahead(next_batch, launched, continues=keep)

    def _forced_runs(self, batch: ScheduledBatch, redo: dict[int, int]) -> dict[int, list[int]]:
        """By row of `batch`: the run its grammar forces from the token the row samples now (that
        token first), where the run goes on past it (`_jumps`' rows, not recomputed ones); the
        step run ahead after `batch` computes the run in the row (overlap.next_batch), and once
        `batch` is read the rest of it is output at once (`_take_run`), as `_jump` takes one in
        a step read before the next. Cut at a stop token or length, and to the scheduler's token
        budget. Read before `batch`'s tokens: its grammars stand before them."""
        rows = self._jumps(batch)
        if not rows:
            return {}
        budget = self.scheduler.config.max_num_batched_tokens - len(batch.seqs)
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
        jumps = self._jumps(batch)
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
                    forced, complete_now = self._take_run(tracked, runs[rid])
                else:
                    forced, complete_now = self._jump(tracked)
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

    def _jumps(self, batch: ScheduledBatch) -> set[str]:
        """The constrained requests of `batch` that take the tokens their grammars force at
        once (`_jump`, or in a step run ahead `_forced_runs`): in a plain engine with
        grammar_drafts on (a speculative one drafts them instead)."""
        if not self.grammars or not self._jumps_alone():
            return set()
        return {s.request.request_id for s in batch.seqs if s.request.request_id in self.grammars}

    def _jumps_alone(self) -> bool:
        """Whether forced runs are taken at once at all: a plain engine (a speculative one
        drafts them instead) with grammar_drafts on."""
        return self.speculator.proposer is None and self.config.speculative.grammar_drafts

    def _take_run(self, tracked: TrackedRequest, run: list[int]) -> tuple[list[int], bool]:
        """The rest of the forced run (`_forced_runs`) that the step run ahead computes for the
        request, after the token this step gave it: taken by the grammar and output now, as
        `_jump` takes a run; and whether the grammar is complete after it."""
        req = tracked.request
        n, _ = count_until_stop(req, run, self.max_model_len)
        taken = run[:n]
        complete = self.grammars.advance(req.request_id, taken)
        req.output_token_ids.extend(taken)
        self.grammars.counters.jumped += len(taken)
        return taken, complete

    def _jump(self, tracked: TrackedRequest, start: bool = False) -> tuple[list[int], bool]:
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


def _with_runs(batch: ScheduledBatch, ids: torch.Tensor) -> torch.Tensor:
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
