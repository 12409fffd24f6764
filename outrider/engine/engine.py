"""EngineCore.step(): schedule -> execute -> postprocess. CPU bookkeeping lives here and in the
scheduler; the model runner owns every tensor."""

from __future__ import annotations

import logging
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
from outrider.engine import overlap
from outrider.engine.block_manager import BlockManager
from outrider.engine.detokenizer import IncrementalDetokenizer, check_stop, count_until_stop
from outrider.engine.limits import check_request, context_limit
from outrider.engine.proposers import build_proposer
from outrider.engine.scheduler import Scheduler
from outrider.engine.tracked import TrackedRequest
from outrider.executor import tp_workers
from outrider.executor.distributed import check_tp_size
from outrider.executor.model_runner import ModelRunner
from outrider.executor.sampler import make_generator
from outrider.executor.spec_step import simple_greedy
from outrider.loaders.checkpoint import Checkpoint, open_checkpoint
from outrider.speculative.controller import SpecController, StepProfile
from outrider.speculative.eagle3_tree import DEFAULT_MAX_STEPS
from outrider.speculative.stats import SpecStats, record_verify
from outrider.speculative.tree_batch import TreeShape

log = logging.getLogger(__name__)

_OBSERVED_ROWS = 16  # rows of a verify step the adaptive controller learns from


class EngineCore:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        if env.num_threads() > 0:
            torch.set_num_threads(env.num_threads())
        self.config = config
        self.checkpoint = checkpoint or open_checkpoint(config.model.model or env.default_model())
        self.tokenizer = self.checkpoint.tokenizer
        self.runner = self._start_runner(config)
        # Within the KV pool, so check_stop's context limit also keeps every request in it.
        self.max_model_len = context_limit(self.runner, config)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.checkpoint.config.eos_token_ids
        )
        self.vocab_size = self.checkpoint.config.vocab_size
        self._tracked: dict[str, TrackedRequest] = {}
        self.proposer = build_proposer(config.speculative, self.runner, self.checkpoint)
        # Async scheduling (engine/overlap.py): opt-in until measured on a GPU; speculative
        # steps are not run ahead.
        self._async = bool(config.scheduler.async_scheduling) and self.proposer is None
        self._ahead: overlap.Ahead | None = None
        self.num_steps_run_ahead = 0
        self._configure_speculation()
        self.spec_stats = SpecStats()
        self.spec_k = 0  # drafts verified in the last decode step (0: plain)
        self.spec_steps_by_k: dict[int, int] = {}  # decode steps by drafts verified

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

    def _configure_speculation(self) -> None:
        """Chains and a device drafter's trees run through the runner's speculative step (a
        drafter on the device drafts inside it). Captures the graphs either way."""
        p, k = self.proposer, self.config.speculative.num_draft_tokens
        self._k_max = k if p is not None else 0
        self._k = self._k_max  # drafts verified this step (the controller's pick)
        self._drafted_only = False  # the last step drafted but verified nothing
        self._observe_phase = 0  # which share of a large batch the controller sees this step
        self._tree: TreeShape | None = None
        if p is not None and p.topk > 1 and p.on_device:
            self._tree = TreeShape(k, p.topk, p.num_steps or min(k, DEFAULT_MAX_STEPS))
        self._stepped = p is not None and (p.topk == 1 or self._tree is not None)
        if self._stepped:
            drafter = p if p.on_device else None
            self.runner.set_speculation(drafter, tuple(range(1, k + 1)), self._tree)
        else:
            self.runner.aux_layers = p.aux_layers if p is not None else ()
        self.runner.capture_graphs()
        self.controller: SpecController | None = None
        # The controller chooses chain lengths; a tree verifies its whole shape every step.
        if (
            self._stepped
            and self._tree is None
            and self.config.speculative.controller == "adaptive"
        ):
            self.controller = SpecController(self._measure_profile(), max_k=k)

    def _measure_profile(self) -> StepProfile:
        runner = self.runner
        table = runner.profile_steps(range(1, self._k_max + 1))
        key = {"device": str(runner.device), "dtype": str(runner.dtype),
               "drafter": self.proposer.name}  # fmt: skip
        log.info("speculative step profile (ms by batch size and k): %s", table)
        return StepProfile(table, key).monotone()

    def use_proposer(self, proposer) -> None:
        """Serve with another proposer (tests build drafters in code); recaptures graphs."""
        self.proposer = proposer
        self._configure_speculation()

    # -- requests ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the problem; the engine's state is untouched either way."""
        check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

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
        self._tracked[req.request_id] = TrackedRequest(
            req, IncrementalDetokenizer(self.tokenizer, req), prompt
        )
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._tracked.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_id)
        if self.controller is not None:
            self.controller.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; return a delta (new text and token ids) per request that advanced.

        With async scheduling, a plain decode step launches the next one before reading its
        own tokens (engine/overlap.py): that step is then taken here instead of a new schedule."""
        if self._ahead is not None:
            batch, ids = self._ahead.batch, self._ahead.token_ids
            self._ahead = None
        else:
            t0 = time.perf_counter()
            batch = self._schedule()
            if batch.is_empty:
                return []
            if self._speculative_step(batch):
                on_device = self.proposer.on_device
                self._drafted_only = on_device and not any(s.drafts for s in batch.seqs)
                output = self.runner.run_spec(batch, self._k, self._k if on_device else 0)
                deltas = self._advance(batch, output)
                self._record_step(batch, self._k, t0)
                return deltas
            if not (self._async and overlap.can_run_ahead(batch)):
                output = self.runner.run(batch)
                deltas = self._advance(batch, output)
                if batch.mode == ForwardMode.DECODE and self._k == 0:
                    self._record_step(batch, 0, t0)
                return deltas
            ids = self.runner.launch(batch)
        self._ahead = self._run_ahead(batch, ids)
        tokens = ids.tolist()  # CPU-GPU sync point (the device is busy with the step run ahead)
        rids = [s.request.request_id for s in batch.seqs]
        return self._advance(batch, StepOutput(rids, [[t] for t in tokens]))

    def _schedule(self) -> ScheduledBatch:
        if self.proposer is None:
            return self.scheduler.schedule()
        if not self._stepped:
            return self.scheduler.schedule()  # as proposed
        self._choose_k()
        if not self.proposer.on_device and self._k:
            # Drafted on demand, for the k chosen: while speculation is off a host proposer
            # costs nothing.
            self._propose()
        lookahead = self._k - 1 if self.proposer.on_device and self._k else 0
        if self._tree is not None:
            lookahead = self._tree.reach - 1
        return self.scheduler.schedule(max_drafts=self._k, lookahead=lookahead)

    def _choose_k(self) -> None:
        """The controller's k for this step's decoding requests. A step that only drafted
        (speculation was off before it) keeps its k one more step, so its drafts are verified
        and acceptance is observed (a probe would otherwise never see a verify)."""
        if self.controller is None:
            return
        if self._drafted_only:
            self._drafted_only = False
            return
        ids = [
            r.request_id
            for r in self.scheduler.running
            if r.num_computed_tokens == r.num_tokens - 1
        ]
        if ids:
            self._k = self.controller.choose(ids)

    def _record_step(self, batch: ScheduledBatch, k: int, t0: float) -> None:
        """The whole step (scheduling, a host proposer's lookup, the runner, the bookkeeping of
        every token it emitted) refines the start-up profile, which timed the runner alone: at
        C=64 on the H200 an n-gram step spent 1.6 ms on the host against plain's 0.6 ms, a
        cost the runner's time never showed and that turned its gain into a loss. A plain
        step taken while speculation was on (no row found drafts) is neither: not recorded."""
        if self.controller is not None:
            ms = (time.perf_counter() - t0) * 1e3
            self.controller.record_step(len(batch.seqs), k, ms)

    def _speculative_step(self, batch: ScheduledBatch) -> bool:
        """Whether the batch runs as one speculative step: chains, every sequence decoding
        (its root and at most k drafts), and speculation on this step."""
        if not self._stepped or self._k == 0 or batch.mode == ForwardMode.PREFILL:
            return False
        if not self.proposer.on_device and not any(s.drafts for s in batch.seqs):
            return False  # nothing to verify and nothing to draft: a plain decode step
        if self._tree is not None and not all(map(simple_greedy, batch.seqs)):
            return False  # trees that sample are verified per sequence (runner.run)
        return all(
            s.sample and s.query_len == 1 + (s.drafts.num_nodes if s.drafts else 0)
            for s in batch.seqs
        )

    def _run_ahead(self, batch: ScheduledBatch, ids: torch.Tensor) -> overlap.Ahead | None:
        """Launch the decode after `batch` on its sampled ids, still on the device; None when
        requests wait to be scheduled or the step cannot run ahead."""
        if self.scheduler.num_waiting or not overlap.can_run_ahead(batch):
            return None
        nxt = overlap.next_batch(batch, self.block_manager, self.max_model_len)
        if nxt is None:
            return None
        next_batch, keep = nxt
        if len(keep) != len(batch.seqs):
            ids = ids.index_select(0, torch.as_tensor(keep, device=ids.device))
        self.num_steps_run_ahead += 1
        return overlap.Ahead(next_batch, self.runner.launch(next_batch, ids))

    def _advance(self, batch: ScheduledBatch, output: StepOutput) -> list[RequestOutput]:
        """Everything after the forward: stops inside accepted runs, the scheduler's and the
        drafter's bookkeeping, detokenizing, finishing, the next drafts."""
        if batch.mode != ForwardMode.PREFILL and self.proposer is not None:
            k = self._k if output.num_accepted is not None else 0
            self.spec_k = k
            self.spec_steps_by_k[k] = self.spec_steps_by_k.get(k, 0) + 1
            for seq in batch.seqs:
                steps = seq.request.metrics.steps_by_k
                steps[k] = steps.get(k, 0) + 1
        if output.num_accepted is not None:
            self._cut_at_token_stops(batch, output)
        self.scheduler.postprocess(batch, output)
        if output.next_drafts is not None:
            self._take_drafts(batch, output)
        elif self.proposer is not None and (batch.mode == ForwardMode.PREFILL or self._k):
            # A device drafter follows the target through steps it did not draft in; after a
            # plain step while speculation is off it skips (its KV there goes stale: later
            # drafts are worse, never wrong).
            self.proposer.observe(batch, output)
        deltas = []
        for rid, new_ids in zip(output.request_ids, output.token_ids):
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue  # aborted while the step ran
            req = tracked.request
            text, new_ids = tracked.detokenize(new_ids)
            if tracked.detokenizer.stop_hit:
                reason = FinishReason.STOP
            else:
                reason = check_stop(req, self.max_model_len)
            if reason is not None:
                self.scheduler.finish(req, reason)
                if req.params.detokenize:
                    text += tracked.detokenizer.flush()  # text held back as a stop string
                del self._tracked[rid]
                if self.proposer is not None:
                    self.proposer.forget(rid)
                if self.controller is not None:
                    self.controller.forget(rid)
            deltas.append(tracked.output(text, new_ids))
        if self.proposer is not None and (self.proposer.on_device or not self._stepped):
            self._propose()  # host proposers of chains draft right before the step instead
        return deltas

    def _cut_at_token_stops(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Several tokens may arrive at once from a verify: keep those up to the first EOS /
        stop id / max_tokens / context end, and record acceptance statistics."""
        sampling = [s for s in batch.seqs if s.sample]
        observe = self.controller is not None and batch.mode != ForwardMode.PREFILL
        # The controller's update is Python per row (~10 us): at most _OBSERVED_ROWS rows a
        # step, a different share each step, keep it far below a step's time at any batch.
        stride = -(-len(sampling) // _OBSERVED_ROWS)
        self._observe_phase = (self._observe_phase + 1) % stride
        for i, seq in enumerate(sampling):
            if (
                observe
                and i % stride == self._observe_phase
                and (seq.drafts is not None or not self.proposer.on_device)
            ):
                # A host proposer drafts all it can (up to the most k): drafts short of k, or
                # none, yielded nothing there and count as rejected. A device drafter's rows
                # hold what the previous step's k asked for: only those were tried.
                n = seq.drafts.num_nodes if self.proposer.on_device else self._k
                self.controller.observe(seq.request.request_id, n, output.num_accepted[i])
            if seq.drafts is None:
                continue
            accepted = output.num_accepted[i]
            self.spec_stats.record(seq.drafts.num_nodes, accepted)
            record_verify(seq.request.metrics, seq.drafts.num_nodes, accepted)
            keep, _ = count_until_stop(seq.request, output.token_ids[i], self.max_model_len)
            if keep < len(output.token_ids[i]):
                output.token_ids[i] = output.token_ids[i][:keep]
                if output.logprobs is not None:
                    output.logprobs[i] = output.logprobs[i][:keep]
                output.num_accepted[i] = min(accepted, keep)

    def _take_drafts(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Drafts made inside the step become each request's drafts for the next one."""
        for seq, drafts in zip((s for s in batch.seqs if s.sample), output.next_drafts):
            req = seq.request
            n = min(drafts.num_nodes, self._room(req))
            if not req.is_finished and n > 0:
                req.drafts = drafts.truncated(n)

    def _propose(self) -> None:
        """Draft for every running request that is decoding, capped so accepted drafts plus
        the final token never pass max_tokens or the context."""
        reqs = [
            r
            for r in self.scheduler.running
            if r.num_computed_tokens == r.num_tokens - 1
            and not r.drafts  # a device drafter already drafted inside the step
        ]
        k = self._k
        if not reqs or k == 0:
            return
        if self.proposer.writes_kv:
            reqs = [r for r in reqs if self._reserve_draft_slots(r, k)]
        for req, drafts in zip(reqs, self.proposer.propose(reqs, k)):
            n = min(drafts.num_nodes, self._room(req))
            req.drafts = None if n <= 0 else drafts.truncated(n)

    def _room(self, req: Request) -> int:
        """Drafts that can still count: accepted ones plus the final token never pass
        max_tokens or the context."""
        room = self.max_model_len - req.num_tokens - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
        return room

    def _reserve_draft_slots(self, req: Request, k: int) -> bool:
        """A drafter that writes its own KV while proposing writes it in slots past the computed
        tokens, which the next VERIFY uses too (root + k drafts): allocate them now, or skip
        drafting for this request when the pool is short (drafts are a bet; nobody is
        preempted for them)."""
        need = self.proposer.positions_needed(k)
        if req.num_computed_tokens + need > self.max_model_len:
            return False  # the last few tokens of the context decode plainly
        return self.block_manager.allocate(req, need)
