"""AsyncEngine: EngineCore.step() in a thread of its own, bridged to asyncio.

    event loop (HTTP)                 engine thread
    generate() --("add", ...)-->      commands queue -> core.add_request
    abort()    --("abort", ids)->     core.abort (frees the request's KV blocks)
    asyncio.Queue <-- call_soon_threadsafe -- core.step() deltas, one queue per generate()
                                      (one call a step and loop: each is a syscall and a wake-up)

A generate() behind the engine (the event loop busy with other streams) takes every delta
queued for a request at once, as one (`merged`): at a server's concurrency the loop then
writes one chunk per request and turn instead of one per step, and keeps up.

Invariants: only the engine thread touches EngineCore's mutable state (the scheduler, block
manager, detokenizers); the event loop reads only immutable fields (tokenizer, vocab_size,
max_model_len, context) and the `stats` snapshot, which the engine thread replaces after every step.
A generate() that ends early (client gone, cancelled) aborts its unfinished requests.

Liveness: the engine thread beats a Heartbeat at every loop turn (at least every
`idle_wait_s` while idle) and before every decoder layer of an eager forward (forward
pre-hooks on the target model's layers; CUDA graph replays skip them, and their steps are
short), so a 40 s prefill chunk beats once per layer instead of looking dead. /health and the
systemd watchdog read it without waiting on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from torch import nn

from outrider.core import RequestOutput, SamplingParams
from outrider.engine.engine import EngineCore
from outrider.executor.model_runner import ModelRunner
from outrider.server.config import ServerConfig

log = logging.getLogger(__name__)

PROBE_PREFIX = "probe-"  # health probes: not counted in metrics
_IDLE_WAIT_S = 0.5  # an idle engine thread wakes (and beats) at least this often...
_IDLE_BEATS_PER_LIMIT = 4  # ...and at least this many times per stall limit

# The stall limit: the heartbeat may be silent for max(stall_s, STALL_FACTOR x the longest gap
# between beats inside any of the last STALL_WINDOW completed steps). A model whose layers (or
# whose sampling, or a host sync after the last layer) take longer than stall_s raises its own
# limit after its first such step; a step that never completes never raises it.
STALL_FACTOR = 10
STALL_WINDOW = 100


class Heartbeat:
    """When the engine thread last showed progress, and how long a silence means it is stuck.

    Written by the engine thread only; any thread may read `last` and `limit_s` (plain float
    attributes, each read atomic) or call age() / fresh()."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.last = time.monotonic()
        self.limit_s = stall_s
        self._gap = 0.0  # the longest gap between beats in the step in flight
        self._gaps: deque[float] = deque(maxlen=STALL_WINDOW)  # the same, per completed step

    def beat(self, *_: object) -> None:
        """Engine thread only; also a forward pre-hook (the module and its inputs are ignored).
        One clock read, a compare and a store: ~2-3 us per layer with PyTorch's hook dispatch
        on a 2-core CPU, against a layer's eager forward of tens of us or more."""
        now = time.monotonic()
        if now - self.last > self._gap:
            self._gap = now - self.last
        self.last = now

    def step_begin(self) -> None:
        self.beat()
        self._gap = 0.0

    def step_end(self) -> None:
        self.beat()
        self._gaps.append(self._gap)
        self.limit_s = max(self.stall_s, STALL_FACTOR * max(self._gaps))

    def age(self) -> float:
        return time.monotonic() - self.last

    def fresh(self) -> bool:
        return self.age() <= self.limit_s


class SharedHeartbeat(Heartbeat):
    """A Heartbeat whose `last` and `limit_s` live in shared memory: the engine process beats,
    the server reads."""

    def __init__(self, stall_s: float, cells) -> None:
        self._cells = cells  # multiprocessing RawArray("d", 2): last, limit_s
        super().__init__(stall_s)

    @property
    def last(self) -> float:
        return self._cells[0]

    @last.setter
    def last(self, value: float) -> None:
        self._cells[0] = value

    @property
    def limit_s(self) -> float:
        return self._cells[1]

    @limit_s.setter
    def limit_s(self, value: float) -> None:
        self._cells[1] = value


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: its first ModuleList named `layers` (HF's layout, e.g.
    LlamaForCausalLM.model.layers); [] when it has none."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers":
            return list(module)
    return []


def hook_layers(core, heartbeat: Heartbeat) -> list:
    """Beat before every decoder layer of the core's target model (call it in the thread that
    steps the core); the hooks' handles. Stand-ins for EngineCore in tests may have no model:
    then only the stepping loop beats."""
    model = getattr(getattr(core, "runner", None), "model", None)
    if not isinstance(model, nn.Module):
        return []
    layers = decoder_layers(model)
    if not layers:
        log.warning(
            "no decoder layers found in %s: the heartbeat beats once per step only, so "
            "/health calls a step longer than %.0f s a stall",
            type(model).__name__, heartbeat.stall_s,
        )  # fmt: skip
    return [layer.register_forward_pre_hook(heartbeat.beat) for layer in layers]


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
    # Decode steps launched before the step before them was read (async scheduling).
    steps_run_ahead: int = 0
    # Steps by kind (engine/step_ledger.py): (kind, steps, seconds, tokens, rows).
    step_ledger: tuple[tuple[str, int, float, int, int], ...] = ()
    # Tensor parallelism: the group's size, what rank 0's collectives moved as (mode, op,
    # calls, bytes), and the target forwards sent to the other ranks as (mode, n). One rank
    # runs no collective and sends no forward: both stay empty there.
    tp_size: int = 1
    collectives: tuple[tuple[str, str, int, int], ...] = ()
    forwards: tuple[tuple[str, int], ...] = ()

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
    def __init__(
        self, core: EngineCore, observer=None, stall_s: float = ServerConfig.health_stall_s
    ) -> None:
        """`observer` (ServerMetrics or None) is called from the engine thread with each
        delta and each finished request. `stall_s`: the least heartbeat silence that counts
        as stuck (see Heartbeat)."""
        self.core = core
        self.checkpoint = getattr(core, "checkpoint", None)  # what names the model
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.context = core.context  # what sets max_model_len, for messages
        self.vocab_size = core.vocab_size
        self.observer = observer
        self.stats = self._snapshot()
        self.last_step_time = time.monotonic()  # last step that returned (or start-up)
        self.heartbeat = Heartbeat(stall_s)
        self.idle_wait_s = min(_IDLE_WAIT_S, stall_s / _IDLE_BEATS_PER_LIMIT)
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

    def release(self) -> None:
        """After `stop`: let go of the engine core, so that it lives no longer than its
        caller's own references to it. A server's routes close over its state, and FastAPI
        keeps its endpoints in a process-wide cache: an in-process server (ServerThread) kept
        its engine, and a CUDA engine's memory, for the life of the process, and the next engine
        found no room for its KV cache. The engine thread must have ended."""
        if self._thread.is_alive():
            raise RuntimeError("release() of an engine whose thread still runs: stop() it first")
        self.core = None

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def stopped(self) -> bool:
        """Whether the engine thread has ended (after `stop`, or an error)."""
        return not self._thread.is_alive()

    @property
    def is_responsive(self) -> bool:
        """Alive, and its heartbeat younger than the stall limit: the engine thread is making
        progress, however slow its step (any thread)."""
        return self.is_alive and self.heartbeat.fresh()

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
        self._post(("add", requests, loop, q))
        try:
            while unfinished:
                queued = [await q.get()]
                while not q.empty():
                    queued.append(q.get_nowait())
                for index, out in _coalesced(queued):
                    if isinstance(out, BaseException):
                        # (a refused request is not this call's to abort: its id may be
                        # another caller's, still running)
                        unfinished.discard(requests[index][0])
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
        self._post(("abort", list(request_ids), notify))

    def abort_all(self) -> None:
        self._post(("abort_all",))

    def _post(self, cmd: tuple) -> None:
        """A command for the engine thread (any thread)."""
        self._commands.put(cmd)

    async def probe(self, timeout: float) -> bool:
        """Generate one token through the whole path; True when it arrives within timeout.
        /health does not use it (it must answer at once): it reads the heartbeat."""
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
        hooks = hook_layers(self.core, self.heartbeat)
        beat = self.heartbeat
        try:
            while not self._stopping.is_set():
                beat.beat()
                busy = self.core.has_unfinished()
                self._apply_commands(block=not busy)
                if self.core.has_unfinished():
                    beat.step_begin()
                    outputs = self.core.step()
                    beat.step_end()
                    self.last_step_time = beat.last
                    self._deliver(outputs)
                self.stats = self._snapshot()
        except BaseException as e:  # the engine is broken: tell every waiter, then stop
            log.exception("engine thread failed")
            self.error = e
            for rid, sink in list(self._sinks.items()):
                self._push(sink, EngineDeadError(f"the engine failed: {e!r}"))
                del self._sinks[rid]
        finally:
            # Here, not in stop(): only this thread runs the model, so no forward sees the
            # hook dict change under it; a core served again gets a fresh heartbeat's hooks.
            for hook in hooks:
                hook.remove()
            log_speculation(self.core)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = (
                self._commands.get(timeout=self.idle_wait_s)
                if block
                else self._commands.get_nowait()
            )
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
        puts: dict[asyncio.AbstractEventLoop, list] = {}
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
            puts.setdefault(sink.loop, []).append((sink.queue, (sink.index, out)))
        for loop, items in puts.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                loop.call_soon_threadsafe(_put_all, items)

    @staticmethod
    def _push(sink: _Sink, item) -> None:
        # RuntimeError: the loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (sink.index, item))

    def _snapshot(self) -> EngineStats:
        return engine_stats(self.core)


def engine_stats(core: EngineCore) -> EngineStats:
    """A snapshot of the core's counters (the thread that steps it)."""
    sched, bm, spec = core.scheduler, core.block_manager, core.speculator
    return EngineStats(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        num_free_blocks=bm.num_free_blocks,
        num_blocks=bm.num_blocks,
        num_preemptions=sched.num_preemptions,
        spec_num_drafts=spec.stats.num_verify_steps,
        spec_num_draft_tokens=spec.stats.num_draft_tokens,
        spec_num_accepted_tokens=spec.stats.num_accepted_tokens,
        spec_accepted_per_position=tuple(spec.stats.accepted_per_position),
        spec_k=spec.last_k,
        spec_steps_by_k=tuple(sorted(spec.steps_by_k.items())),
        steps_run_ahead=getattr(core, "num_steps_run_ahead", 0),
        step_ledger=core.ledger.snapshot() if hasattr(core, "ledger") else (),
        **_collective_stats(getattr(core, "runner", None)),
    )


SPECULATION_SUMMARY = "speculation over the engine's life: "


def log_speculation(core: EngineCore) -> None:
    """One line on what speculation did in this engine's life, as it stops (none without:
    a stand-in core has no speculator). A warning, as the start-up profile's lines are: what
    a user of the default log level should see."""
    speculator = getattr(core, "speculator", None)
    text = speculator.summary() if speculator is not None else None
    if text:
        log.warning("%s%s", SPECULATION_SUMMARY, text)


def _collective_stats(runner: ModelRunner | None) -> dict:
    """EngineStats' tensor-parallel fields from the runner's counts (a copy of a few small
    dicts per step; all empty on one rank)."""
    if runner is None:
        return {}
    collectives, forwards = [], []
    for mode, ops in sorted(runner.collective_counts().items()):
        for op, c in sorted(ops.items()):
            if op == "forward":
                forwards.append((mode, c["calls"]))
            else:
                collectives.append((mode, op, c["calls"], c["bytes"]))
    return {
        "tp_size": runner.tp.size,
        "collectives": tuple(collectives),
        "forwards": tuple(forwards),
    }


def _put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _coalesced(queued: list[tuple[int, object]]) -> list[tuple[int, object]]:
    """What a generate() found queued, each request's successive deltas merged (`merged`), in
    the order the requests first appear; an exception ends it, after what came before."""
    out: dict[int, RequestOutput] = {}
    for i, (index, item) in enumerate(queued):
        if not isinstance(item, RequestOutput) or item.completions is not None:
            return [*out.items(), (index, item), *queued[i + 1 :]]
        out[index] = merged(out[index], item) if index in out else item
    return list(out.items())


def merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two successive deltas of one request as one: text and tokens (and logprobs) joined,
    the later one's state (finished, reason, metrics)."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:  # one entry a token
        logprobs = [
            *(a.logprobs or [{}] * len(a.token_ids)),
            *(b.logprobs or [{}] * len(b.token_ids)),
        ]
    return RequestOutput(
        b.request_id, b.prompt, b.prompt_token_ids, a.text + b.text, a.token_ids + b.token_ids,
        b.finished, b.finish_reason, b.metrics, logprobs,
    )  # fmt: skip


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
