"""AsyncEngine: EngineCore.step() in a thread of its own, bridged to asyncio.

    event loop (HTTP)                 engine thread
    generate() --("add", ...)-->      commands queue -> core.add_request
    abort()    --("abort", ids)->     core.abort (frees the request's KV blocks)
    asyncio.Queue <-- call_soon_threadsafe -- core.step() deltas, one queue per generate()

Invariants: only the engine thread touches EngineCore's mutable state (the scheduler, block
manager, detokenizers); the event loop reads only immutable fields (tokenizer, vocab_size,
max_model_len) and the `stats` snapshot, which the engine thread replaces after every step.
A generate() that ends early (client gone, cancelled) aborts its unfinished requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from outrider.core import RequestOutput, SamplingParams
from outrider.engine.engine import EngineCore

log = logging.getLogger(__name__)

PROBE_PREFIX = "probe-"  # health probes: not counted in metrics


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of engine-wide counters, replaced (never mutated) by the engine thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 1
    num_preemptions: int = 0
    spec_num_drafts: int = 0  # verify steps: one per speculating sequence per step
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # The adaptive controller: the draft length it chose last (0: plain) and steps per choice.
    spec_k: int = 0
    spec_steps_by_k: tuple[tuple[int, int], ...] = ()

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int  # the request's position in its generate() call
    last_token_time: float = field(default_factory=time.perf_counter)
    has_tokens: bool = False


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, core: EngineCore, observer=None) -> None:
        """`observer` (ServerMetrics or None) is called from the engine thread with each
        delta and each finished request."""
        self.core = core
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.vocab_size = core.vocab_size
        self.observer = observer
        self.stats = self._snapshot()
        self.last_step_time = time.monotonic()  # last step that returned (or start-up)
        self.error: BaseException | None = None
        self.num_active = 0  # generate() calls in progress (event loop thread only)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outrider-engine", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- the event loop's side -----------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """EngineCore.validate reads only fields fixed at start-up: safe from any thread."""
        self.core.validate(prompt_token_ids, params)

    async def generate(
        self, requests: list[tuple[str, list[int], SamplingParams]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run (request_id, prompt ids, params) requests together; yield (index, delta) as the
        engine produces them, each request ending with a delta whose `finished` is true.
        Closing the iterator early aborts whatever has not finished."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine thread has stopped: {self.error!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        unfinished = {rid for rid, _, _ in requests}
        self.num_active += 1
        self._commands.put(("add", requests, loop, q))
        try:
            while unfinished:
                index, out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finished:
                    unfinished.discard(out.request_id)
                yield index, out
        finally:
            self.num_active -= 1
            if unfinished:
                self.abort(sorted(unfinished))

    def abort(self, request_ids: list[str], notify: bool = False) -> None:
        """Abort requests (thread-safe). notify=True also ends their generate() with a final
        delta whose finish_reason is "abort" (shutdown); otherwise the caller is gone."""
        self._commands.put(("abort", list(request_ids), notify))

    def abort_all(self) -> None:
        self._commands.put(("abort_all",))

    async def probe(self, timeout: float) -> bool:
        """Generate one token through the whole path; True when it arrives within timeout."""
        ids = [self.tokenizer.bos_token_id or 0]
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        rid = f"{PROBE_PREFIX}{time.monotonic_ns()}"

        async def one() -> bool:
            async for _, out in self.generate([(rid, ids, params)]):
                if out.finished:
                    return len(out.token_ids) == 1
            return False

        try:
            return await asyncio.wait_for(one(), timeout)
        except (asyncio.TimeoutError, EngineDeadError):
            return False

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                busy = self.core.has_unfinished()
                self._apply_commands(block=not busy)
                if self.core.has_unfinished():
                    outputs = self.core.step()
                    self.last_step_time = time.monotonic()
                    self._deliver(outputs)
                self.stats = self._snapshot()
        except BaseException as e:  # the engine is broken: tell every waiter, then stop
            log.exception("engine thread failed")
            self.error = e
            for rid, sink in list(self._sinks.items()):
                self._push(sink, EngineDeadError(f"the engine failed: {e!r}"))
                del self._sinks[rid]

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, requests, loop, q = cmd
            for index, (rid, ids, params) in enumerate(requests):
                sink = _Sink(loop, q, index)
                try:
                    self.core.add_request(ids, params, request_id=rid)
                except ValueError as e:  # validated before, so only a race (duplicate id)
                    self._push(sink, e)
                    continue
                self._sinks[rid] = sink
        elif kind == "abort":
            _, ids, notify = cmd
            for rid in ids:
                self.core.abort(rid)
                sink = self._sinks.pop(rid, None)
                if notify and sink is not None:
                    self._push(sink, _aborted(rid))
        elif kind == "abort_all":
            self._apply(("abort", list(self._sinks), True))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if self.observer is not None and not out.request_id.startswith(PROBE_PREFIX):
                since = now - sink.last_token_time if sink.has_tokens else None
                self.observer.on_delta(out, since)
                if out.finished:
                    self.observer.on_finished(out)
            if out.token_ids:
                sink.last_token_time, sink.has_tokens = now, True
            if out.finished:
                del self._sinks[out.request_id]
            self._push(sink, out)

    @staticmethod
    def _push(sink: _Sink, item) -> None:
        # RuntimeError: the loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (sink.index, item))

    def _snapshot(self) -> EngineStats:
        sched, bm, spec = self.core.scheduler, self.core.block_manager, self.core.spec_stats
        return EngineStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            num_preemptions=sched.num_preemptions,
            spec_num_drafts=spec.num_verify_steps,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            spec_k=self.core.spec_k,
            spec_steps_by_k=tuple(sorted(self.core.spec_steps_by_k.items())),
        )


def _aborted(request_id: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        text="",
        token_ids=[],
        finished=True,
        finish_reason="abort",
        metrics={},
    )
