"""Continuous batching: which requests compute how many tokens in the next step.

One step has a token budget (max_num_batched_tokens) and at most max_num_seqs running requests.
The budget goes first to the running decodes (one token each, plus the drafts a verify
carries), then to short prompts: running ones mid-prefill, then waiting ones admitted FIFO while
seats last. A long prompt (more than long_prefill_token_threshold tokens still to compute) comes
last: it computes at most the threshold a step, from what the others left, and only the
max_long_partial_prefills long prompts with the fewest tokens left advance (the others keep
their KV and wait). So a request arriving during a long prefill is not queued behind all of it:
a short one joins the next step, a long one shorter than the prefill in flight takes its turn. KV memory is still taken in admission order (running
requests before waiting ones): when the pool runs dry, the latest admitted request is preempted
by recompute: its blocks are freed and it goes back to the front of the queue, to recompute its
prompt and outputs later (the prefix cache usually returns most of them).

Budget 8, threshold 4, chunked prefill; A (a 2-token prompt) and L (40 tokens) arrive
together, S (3 tokens) after step 2:

    step 1   A: prompt[0:2]                   L: prompt[0:4]     (4: the threshold)
    step 2   A: 1 token                       L: prompt[4:8]
    step 3   A: 1 token    S: prompt[0:3]     L: prompt[8:12]    S samples its first token
    step 4   A: 1 token    S: 1 token         L: prompt[12:16]
    ...      L: 4 tokens a step while more than 4 are left; prompt[36:40] in step 10

With threshold 0 (no prompt is long) L takes the 7 tokens A leaves every step, and S, queued
behind it, samples its first token in step 7 instead of 3.
"""

from __future__ import annotations

import heapq
import time
from collections import deque

from outrider.config import SchedulerConfig
from outrider.core import (
    FinishReason,
    ForwardMode,
    Request,
    RequestStatus,
    ScheduledBatch,
    ScheduledSeq,
    StepOutput,
)
from outrider.engine.block_manager import BlockManager, cdiv
from outrider.speculative.base import SeqDrafts


class Scheduler:
    """Invariants between steps:
    - waiting requests hold no blocks and have num_computed_tokens 0 (new or preempted);
    - running requests are in admission order, at most max_num_seqs of them, and each holds
      blocks covering its computed tokens;
    - every unfinished request is in exactly one of waiting and running.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        device_type: str = "cpu",
    ) -> None:
        """device_type: where the steps run ("cpu", "cuda"), which sets the default long-prefill
        threshold (SchedulerConfig.long_prefill_tokens)."""
        if max_model_len < 2:
            raise ValueError(f"invalid max_model_len={max_model_len}: use an integer >= 2")
        self.config = config
        self.long_prefill_tokens = config.long_prefill_tokens(device_type)
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._max_drafts: int | None = None  # this step's, set by schedule()
        self._lookahead = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def add_request(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already queued: use unique ids")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id} has an empty prompt: pass >= 1 token")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {req.request_id} has a {req.num_prompt_tokens}-token prompt, leaving no "
                f"room to generate within max_model_len={self.max_model_len}: shorten the prompt "
                "or raise max_model_len"
            )
        req.status = RequestStatus.WAITING
        req.metrics.num_prompt_tokens = req.num_prompt_tokens
        self.waiting.append(req)
        self._requests[req.request_id] = req

    def schedule(self, max_drafts: int | None = None, lookahead: int = 0) -> ScheduledBatch:
        """max_drafts: drafts a decoding request verifies this step at most (its drafts are cut
        to that; 0 decodes plainly; None keeps them all). lookahead: slots a drafter running
        inside the step writes past the verified ones (EAGLE-3's chain: k - 1), reserved for
        decoding requests where the pool has them and given back after the step."""
        batch = ScheduledBatch(mode=ForwardMode.DECODE, seqs=[])
        self._max_drafts, self._lookahead = max_drafts, lookahead
        # Long prefills take slots for a chunk when their turn for memory comes (running ones in
        # admission order, then waiting ones FIFO) but compute last, from the budget left then.
        longs: list[tuple[Request, int]] = []
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, longs)
        # After a preemption memory is short: admitting more now would only preempt again next
        # step. (A preemption always leaves a non-empty batch: a request that would have to
        # preempt itself while alone raises instead.)
        if not batch.preempted:
            budget = self._schedule_waiting(batch, budget, longs)
        self._schedule_long(batch, budget, longs)
        if not batch.seqs and self.has_unfinished():
            # Unreachable while the invariants hold; an empty batch would spin the engine forever.
            req = self.waiting[0] if self.waiting else self.running[0]
            raise RuntimeError(
                f"nothing could be scheduled: request {req.request_id} ({req.num_tokens} tokens) "
                f"waits with {self.num_running} running and {self.block_manager.num_free_blocks}"
                f" of {self.block_manager.num_blocks} KV blocks free; were finished requests "
                "passed to Scheduler.finish?"
            )
        batch.mode = _mode(batch.seqs)
        return batch

    def schedule_prompts(self, budget: int) -> ScheduledBatch:
        """Prompt chunks alone, beside decodes already launched (a speculative step run ahead,
        engine/overlap.py): running requests mid-prompt in admission order, then waiting ones
        admitted FIFO, long prompts last, as `schedule` orders them, from `budget` tokens.
        Nobody is preempted (the decodes in flight hold their KV): a chunk whose slots do not
        fit waits for a step scheduled as usual."""
        batch = ScheduledBatch(mode=ForwardMode.PREFILL, seqs=[])
        self._max_drafts, self._lookahead = 0, 0
        longs: list[tuple[Request, int]] = []
        advancing = self._advancing_longs()
        for req in self.running:
            if budget <= 0:
                break
            if _tokens_left(req) <= 1:
                continue  # a decode
            long = self._is_long(req)
            if long and req.request_id not in advancing:
                continue
            num_new = min(self.long_prefill_tokens, budget) if long else self._num_new_tokens(
                req, budget
            )  # fmt: skip
            if num_new == 0 or not self.block_manager.allocate(req, num_new):
                continue
            if long:
                longs.append((req, num_new))
            else:
                self._add_seq(batch, req, num_new)
                budget -= num_new
        budget = self._schedule_waiting(batch, budget, longs)
        self._schedule_long(batch, budget, longs)
        batch.mode = _mode(batch.seqs) if batch.seqs else ForwardMode.PREFILL
        return batch

    def postprocess(self, batch: ScheduledBatch, output: StepOutput, hold: int = 0) -> None:
        """Advance each scheduled request by what the step computed and append sampled tokens.
        Stop conditions are the engine's, which then calls `finish`. hold: positions past a
        request's tokens whose blocks stay (a step launched before this one was read writes
        there); the rest past its tokens go back."""
        expected = [s.request.request_id for s in batch.seqs if s.sample]
        if expected != output.request_ids or len(output.token_ids) != len(expected):
            raise ValueError(
                f"step output for requests {output.request_ids} with {len(output.token_ids)} "
                f"token lists does not match the batch's sampling sequences {expected}: the "
                "runner must return one entry per seq with sample=True, in batch order"
            )
        new_tokens = iter(output.token_ids)
        new_logprobs = iter(output.logprobs) if output.logprobs is not None else None
        new_accepted = iter(output.num_accepted) if output.num_accepted is not None else None
        now = time.perf_counter()
        for seq in batch.seqs:
            req = seq.request
            tokens = next(new_tokens) if seq.sample else None
            logprobs = next(new_logprobs) if seq.sample and new_logprobs is not None else None
            accepted = next(new_accepted) if seq.sample and new_accepted is not None else None
            if req.is_finished:
                continue  # aborted while the step ran; its blocks are already freed
            if seq.start_pos != req.num_computed_tokens:
                raise RuntimeError(
                    f"request {req.request_id} was scheduled at position {seq.start_pos} but has "
                    f"{req.num_computed_tokens} computed tokens: was this batch postprocessed twice?"
                )
            if seq.drafts is None:
                req.num_computed_tokens += seq.query_len
            else:
                # The root's and the accepted drafts' KV is valid; rejected slots roll back.
                req.num_computed_tokens = seq.start_pos + 1 + accepted
            if tokens is not None:
                req.output_token_ids.extend(tokens)
                if logprobs is not None:
                    req.output_logprobs.extend(logprobs)
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
            if seq.drafts is not None or (seq.sample and seq.query_len == 1):
                # Free blocks of rejected drafts and of a drafter's lookahead.
                self.block_manager.trim(req, req.num_tokens + hold)
            self.block_manager.commit(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        if self._requests.get(req.request_id) is not req:
            raise ValueError(
                f"finish of request {req.request_id} (status {req.status.value}) that this "
                "scheduler does not hold: finished twice, or never added?"
            )
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if self.block_manager.tracks(req):
            self.block_manager.free(req)
        del self._requests[req.request_id]
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = time.perf_counter()

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted; None when no unfinished request has that id."""
        req = self._requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        return req

    # -- building a step ---------------------------------------------------------------------

    def _schedule_running(
        self, batch: ScheduledBatch, budget: int, longs: list[tuple[Request, int]]
    ) -> int:
        """Schedule running requests in order, a prompt chunk only from the budget the decodes
        after it leave; long prefills take slots and join `longs`. Returns the budget left."""
        # need[i]: what running[i] takes as a decode (0 for a prompt); the decodes after
        # position i need prefix[len(running)] - prefix[i + 1], whatever preemption pops.
        prefix = [0]
        for req in self.running:
            prefix.append(prefix[-1] + self._decode_need(req))
        advancing = self._advancing_longs()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens - req.num_computed_tokens > 1:  # a prompt: after later decodes
                room = budget - (prefix[len(self.running)] - prefix[i + 1])
                if self._is_long(req):
                    num_new = min(self.long_prefill_tokens, room)
                    if req.request_id not in advancing or num_new <= 0:
                        i += 1  # paused behind shorter long prompts, or no budget left
                        continue
                    if not self._allocate_or_preempt(req, num_new, batch):
                        break  # req was the last running request and preempted itself
                    longs.append((req, num_new))
                    i += 1
                    continue
                num_new = self._num_new_tokens(req, room) if room > 0 else 0
            else:
                num_new = 1
            if num_new == 0:
                i += 1  # does not fit what is left of the budget: it waits a step
                continue
            drafts, req.drafts = self._drafts(req), None  # consumed now, verified or dropped
            # Drafts (and a drafter's lookahead) ride on the decode only if their slots fit
            # without preempting anyone: a draft is a bet, a running request's KV is not.
            n = drafts.num_nodes if drafts else 0
            room = self.max_model_len - req.num_computed_tokens
            if (
                num_new == 1
                and req.num_tokens - req.num_computed_tokens == 1  # a decode, not a prompt
                # chunk the budget cut to one token: its drafts are stale, its next token known
                and (n or self._lookahead)
                and n + 1 <= budget
                and self.block_manager.allocate(req, min(1 + n + self._lookahead, room))
            ):
                self._add_seq(batch, req, 1 + n, drafts or None)
                budget -= 1 + n
                i += 1
                continue
            if not self._allocate_or_preempt(req, num_new, batch):
                break  # req was the last running request and preempted itself
            self._add_seq(batch, req, num_new)
            budget -= num_new
            i += 1
        return budget

    def _advancing_longs(self) -> set[str]:
        """The running long prompts that compute a chunk this step: the
        max_long_partial_prefills with the fewest tokens left."""
        longs = (r for r in self.running if self._is_long(r))
        n = self.config.max_long_partial_prefills
        return {r.request_id for r in heapq.nsmallest(n, longs, key=_tokens_left)}

    def _drafts(self, req: Request) -> SeqDrafts | None:
        """req's drafts cut to this step's max_drafts (0: none)."""
        drafts = req.drafts
        if drafts and self._max_drafts is not None:
            drafts = drafts.truncated(self._max_drafts) if self._max_drafts else None
        return drafts

    def _decode_need(self, req: Request) -> int:
        """Budget req takes as a decode: its token and the drafts it verifies; 0 for a prompt."""
        if req.num_tokens - req.num_computed_tokens != 1:
            return 0
        drafts = req.drafts
        if not drafts or self._max_drafts == 0:
            return 1
        n = drafts.num_nodes
        return 1 + (n if self._max_drafts is None else min(n, self._max_drafts))

    def _is_long(self, req: Request) -> bool:
        return 0 < self.long_prefill_tokens < req.num_tokens - req.num_computed_tokens

    def _allocate_or_preempt(self, req: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Allocate req's new slots, preempting from the back of `running` until they fit.
        Victims are never requests already scheduled this step: those sit before req."""
        while not self.block_manager.allocate(req, num_new):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                # Alone, with the whole pool free or evictable, and still short: never fits.
                raise self._never_fits(req, req.num_computed_tokens + num_new)
            self._preempt(victim, batch)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Free req's KV and queue it first; it keeps output_token_ids and later recomputes
        prompt + outputs as one prompt."""
        assert self.running[-1] is req, "preemption takes the latest admitted request"
        self.running.pop()
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.drafts = None  # drafted after its last token; it recomputes as a prompt first
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        # Several preemptions in one step pop running from the back and each goes to the
        # front, so the queue keeps their admission order.
        self.waiting.appendleft(req)
        batch.preempted.append(req)

    def _schedule_waiting(
        self, batch: ScheduledBatch, budget: int, longs: list[tuple[Request, int]]
    ) -> int:
        """Admit waiting requests FIFO while seats, budget and KV last; a long prompt takes slots
        for its chunk here and joins `longs`, or, with max_long_partial_prefills already
        advancing, stays queued while short prompts behind it go. Returns the budget left."""
        bm = self.block_manager
        i = 0
        while i < len(self.waiting) and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting[i]
            if cdiv(req.num_tokens + 1, bm.block_size) > bm.num_blocks:
                raise self._never_fits(req, req.num_tokens + 1)
            num_cached = bm.match_prefix(req)
            num_new = req.num_tokens - req.num_computed_tokens
            long = self._is_long(req)
            if long and not self._advances(req, longs):
                self._unmatch(req)
                i += 1
                continue
            if long:
                num_new = min(self.long_prefill_tokens, budget)
            elif num_new > budget:
                if self.config.enable_chunked_prefill:
                    num_new = budget
                elif batch.seqs or longs:
                    self._unmatch(req)
                    break
                # else: an empty batch takes the whole over-budget prompt, or it never runs
            if not bm.allocate(req, num_new):
                self._unmatch(req)
                break
            del self.waiting[i]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_tokens = num_cached  # not recounted after preemption
            if long:
                longs.append((req, num_new))
            else:
                self._add_seq(batch, req, num_new)
                budget -= num_new
        return budget

    def _advances(self, req: Request, longs: list[tuple[Request, int]]) -> bool:
        """Whether the waiting long prompt req would be among the max_long_partial_prefills
        long prompts with the fewest tokens left, beside `longs`."""
        if len(longs) < self.config.max_long_partial_prefills:
            return True
        return _tokens_left(req) < max(_tokens_left(r) for r, _ in longs)

    def _schedule_long(
        self, batch: ScheduledBatch, budget: int, longs: list[tuple[Request, int]]
    ) -> None:
        """The chunks of the max_long_partial_prefills long prompts with the fewest tokens left,
        from the budget everyone else left; slots taken for more than that go back (a long
        prompt given nothing this step keeps its seat and its KV)."""
        longs.sort(key=lambda long: _tokens_left(long[0]))  # stable: ties in admission order
        for k, (req, num_slots) in enumerate(longs):
            num_new = min(num_slots, budget) if k < self.config.max_long_partial_prefills else 0
            if num_new < num_slots:
                self.block_manager.trim(req, req.num_computed_tokens + num_new)
            if num_new:
                self._add_seq(batch, req, num_new)
                budget -= num_new

    def _unmatch(self, req: Request) -> None:
        """Return the references match_prefix took, so a request left waiting holds nothing."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0

    def _add_seq(
        self, batch: ScheduledBatch, req: Request, num_new: int, drafts: SeqDrafts | None = None
    ) -> None:
        start = req.num_computed_tokens
        if drafts is not None:  # VERIFY: the root (last accepted token) and its drafts
            token_ids = [*_token_slice(req, start, start + 1), *drafts.token_ids]
        else:
            token_ids = _token_slice(req, start, start + num_new)
        batch.seqs.append(
            ScheduledSeq(
                request=req,
                token_ids=token_ids,
                start_pos=start,
                block_ids=list(req.block_ids),
                sample=drafts is not None or start + num_new == req.num_tokens,
                drafts=drafts,
            )
        )

    def _never_fits(self, req: Request, num_positions: int) -> RuntimeError:
        bm = self.block_manager
        return RuntimeError(
            f"request {req.request_id} ({req.num_prompt_tokens} prompt + "
            f"{len(req.output_token_ids)} output tokens) needs {cdiv(num_positions, bm.block_size)}"
            f" KV blocks for {num_positions} positions, but the whole pool has {bm.num_blocks} "
            f"blocks of {bm.block_size} tokens: enlarge the KV pool (num_blocks, cpu_kv_bytes or "
            "gpu_memory_utilization) or lower max_tokens / max_model_len"
        )

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens req computes this step: all it lacks, or a budget-sized chunk when chunked
        prefill is on, else 0 (it waits)."""
        num_new = req.num_tokens - req.num_computed_tokens
        if num_new <= budget:
            return num_new
        return budget if self.config.enable_chunked_prefill else 0


def _mode(seqs: list[ScheduledSeq]) -> ForwardMode:
    """PREFILL when any sequence computes a prompt chunk; else VERIFY when any carries drafts;
    else DECODE (every sequence computes one token and samples)."""
    if any(s.drafts is None and (s.query_len > 1 or not s.sample) for s in seqs):
        return ForwardMode.PREFILL
    if any(s.drafts is not None for s in seqs):
        return ForwardMode.VERIFY
    return ForwardMode.DECODE


def _tokens_left(req: Request) -> int:
    return req.num_tokens - req.num_computed_tokens


def _token_slice(req: Request, start: int, end: int) -> list[int]:
    """req.all_token_ids[start:end] without concatenating the whole sequence: a decode step
    copies one token, not the full context, for every running request."""
    num_prompt = req.num_prompt_tokens
    if start >= num_prompt:
        return req.output_token_ids[start - num_prompt : end - num_prompt]
    if end <= num_prompt:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - num_prompt]
