"""EngineProcess: the engine core in a process of its own, bridged to the server's event loop.

    server process                                  engine process
    event loop: generate() --("add", requests)-->   pipe -> core.add_request
                abort()    --("abort", ids)---->          core.abort
    receiver thread: sinks <--("out", deltas, stats)--    core.step(), one message a step
    /health reads the heartbeat <-- shared memory --      beats (loop turns, decoder layers)

Why: in one process the engine's host work (scheduling, launching steps, detokenizing) and the
event loop's (HTTP, streaming) take turns on one interpreter. At 64 streams on an H100 host the
server gave 8.4k tok/s of plain decoding where `LLM` gave 34k; with the engine apart each side
has an interpreter of its own, as vLLM's engine core has.

The server's side keeps AsyncEngine's surface (generate, abort, probe, validate, stats,
heartbeat): routes, metrics and /health do not know which they have. Its receiver thread plays
the engine thread's part for the sinks: a command posted before its request's first message
is sent is applied before that message is read (`_post` queues it first), so every delta finds
its sink. Requests are validated in the server process on its own copy of what validation
reads (the tokenizer, vocabulary, context limit; a constraint compiled once here too, cached by
its text), so a bad one gets its 400 without a round trip.

The engine process ignores SIGINT and SIGTERM (a terminal's Ctrl-C and systemd's stop reach
every process of the group): it ends on the server's "stop", or when the server's end of the
pipe closes (the server died), and never outlives it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from types import SimpleNamespace

from outrider import env
from outrider.config import EngineConfig
from outrider.core import RequestOutput, SamplingParams
from outrider.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    Heartbeat,
    _aborted,
    _Sink,
    engine_stats,
    hook_layers,
)
from outrider.server.config import ServerConfig
from outrider.server.engine_load import load_engine

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 3600.0  # building a large model's engine (loading, capturing graphs)
_STATS_EVERY_S = 0.02  # the engine process sends its counters at most this often while busy...
_JOIN_S = 10.0  # ...and, at stop, gets this long to end before it is terminated


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


class EngineProcess(AsyncEngine):
    """AsyncEngine's surface over an engine core built and stepped in another process.

    `build` is what the engine process calls to make its core: an EngineConfig (the server's
    load_engine: built, then warmed up) or any picklable callable returning an object with
    EngineCore's surface (tests: outrider.testing.server_core.StandInCore). Construction
    returns once the core is built; its error, if building fails, is raised here."""

    def __init__(
        self,
        build: EngineConfig | Callable[[], object],
        observer=None,
        stall_s: float = ServerConfig.health_stall_s,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA is initialised in the child alone
        cells = ctx.RawArray("d", 2)
        cells[0], cells[1] = time.monotonic(), stall_s
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(build, child_conn, cells, stall_s, env.thread_profile(), _log_level()),
            name="outrider-engine",
        )
        self._proc.start()
        child_conn.close()
        ready = self._wait_ready()
        self.tokenizer = ready["tokenizer"]
        self.max_model_len = ready["max_model_len"]
        self.context = ready["context"]
        self.vocab_size = ready["vocab_size"]
        self.checkpoint = SimpleNamespace(path=ready["checkpoint_path"])
        self.core = None  # no core in this process
        self.observer = observer
        self.stats = ready["stats"]
        self.last_step_time = time.monotonic()
        self.heartbeat = SharedHeartbeat(stall_s, cells)
        self.idle_wait_s = 0.5
        self.error: BaseException | None = None
        self.num_active = 0
        self.steps_received = 0  # the engine process's steps that sent deltas
        self._grammars = None  # outrider.engine.structured.Grammars, to validate constraints
        self._send_lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._sinks: dict[str, _Sink] = {}
        self._refused: set[str] = set()  # ids refused here as duplicates (receiver thread)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outrider-receiver", daemon=True)

    def _wait_ready(self) -> dict:
        try:
            return self._await_ready()
        except BaseException:  # failed, timed out, or Ctrl-C while the engine loads
            if self._proc.is_alive():  # (it ignores SIGINT and SIGTERM)
                self._proc.kill()
            self._proc.join(_JOIN_S)
            raise

    def _await_ready(self) -> dict:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._conn.poll(0.5):
                try:
                    kind, payload = self._conn.recv()
                except EOFError:
                    break
                if kind == "ready":
                    return payload
                self._proc.join(_JOIN_S)
                raise payload  # ("failed", the exception)
            if not self._proc.is_alive():
                break
        self._proc.join(_JOIN_S)
        if self._proc.is_alive():
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {_START_TIMEOUT_S:.0f} s")
        raise RuntimeError(
            f"the engine process exited with code {self._proc.exitcode} before it was ready: "
            "see the log above for its error"
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self, timeout: float = _JOIN_S) -> None:
        self._stopping.set()
        self._send(("stop",))
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s: terminating it", timeout)
            self._proc.terminate()
            self._proc.join(timeout)

    def release(self) -> None:
        if self._thread.is_alive():
            raise RuntimeError("release() of an engine whose thread still runs: stop() it first")
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._conn.close()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and self._proc.is_alive()

    # -- the event loop's side -----------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """What EngineCore.validate checks, on this process's copy of what it reads."""
        from outrider.engine.engine import validate_request
        from outrider.engine.structured import Grammars

        if params.structured_outputs is not None and self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        validate_request(prompt_token_ids, params, self.vocab_size, self.context, self._grammars)

    def _post(self, cmd: tuple) -> None:
        """Queue the command for the receiver (which keeps the sinks) before the engine process
        hears of it, so that its first delta finds its sink; then wake the receiver."""
        self._commands.put(cmd)
        kind = cmd[0]
        if kind == "add":
            self._send(("add", cmd[1]))
        elif kind == "abort":
            self._send(("abort", cmd[1]))
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _send(self, msg: tuple) -> None:
        with self._send_lock, contextlib.suppress(OSError, ValueError):  # closed: it has ended
            self._conn.send(msg)

    # -- the receiver thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                ready = wait([self._conn, self._wake_r], timeout=self.idle_wait_s)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                self._apply_commands(block=False)
                while self._conn.poll():
                    msg = self._conn.recv()
                    # A request posted after the commands above were applied may have been
                    # answered already: its command was queued before it was sent, so it is in
                    # the queue now, and its sink must be there before its first delta.
                    self._apply_commands(block=False)
                    self._receive(msg)
                if not self._proc.is_alive() and not self._conn.poll():
                    raise EngineDeadError(
                        f"the engine process exited with code {self._proc.exitcode}"
                    )
        except BaseException as e:  # the engine is gone: tell every waiter, then stop
            if self._stopping.is_set() and isinstance(e, (EOFError, OSError)):
                return
            if isinstance(e, (EOFError, OSError)):  # its end of the pipe closed: it has exited
                self._proc.join(_JOIN_S)
                e = EngineDeadError(f"the engine process exited with code {self._proc.exitcode}")
            elif not isinstance(e, EngineDeadError):
                e = EngineDeadError(f"the engine process failed: {e!r}")
            log.error("%s", e)
            self.error = e
            for rid, sink in list(self._sinks.items()):
                self._push(sink, e)
                del self._sinks[rid]

    def _receive(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, deltas, stats = msg
            self.last_step_time = time.monotonic()
            self.steps_received += 1
            self._deliver([_output(d) for d in deltas])
            if stats is not None:
                self.stats = stats
        elif kind == "stats":
            self.stats = msg[1]
        elif kind == "reject":  # add_request refused it: a race the validation did not see
            _, rid, error = msg
            if rid in self._refused:  # refused here already, its namesake left alone
                self._refused.discard(rid)
                return
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                self._push(sink, error)
        elif kind == "dead":
            raise EngineDeadError(f"the engine failed: {msg[1]}")

    def _apply(self, cmd: tuple) -> None:
        """The sinks' side of a command; the engine process has been sent its own part."""
        kind = cmd[0]
        if kind == "add":
            _, requests, loop, q = cmd
            for index, (rid, _, _) in enumerate(requests):
                sink = _Sink(loop, q, index)
                if rid in self._sinks:  # the engine process refuses it too ("reject")
                    self._refused.add(rid)
                    self._push(sink, ValueError(f"request id {rid!r} is already in use"))
                    continue
                self._sinks[rid] = sink
        elif kind == "abort":
            _, ids, notify = cmd
            for rid in ids:
                sink = self._sinks.pop(rid, None)
                if notify and sink is not None:
                    self._push(sink, _aborted(rid))
        elif kind == "abort_all":
            ids = list(self._sinks)
            self._send(("abort", ids))
            self._apply(("abort", ids, True))


# -- deltas on the wire: tuples, the prompt left out (the server never reads it back) ----------


def _wire(out: RequestOutput) -> tuple:
    return (
        out.request_id, out.text, out.token_ids, out.finished, out.finish_reason,
        out.metrics, out.logprobs, out.completions,
    )  # fmt: skip


def _output(d: tuple) -> RequestOutput:
    rid, text, ids, finished, reason, metrics, logprobs, completions = d
    return RequestOutput(rid, None, [], text, ids, finished, reason, metrics, logprobs, completions)


# -- the engine process ----------------------------------------------------------------------


def _log_level() -> int:
    """The level this process logs at, for the engine process to log at too."""
    return logging.getLogger().getEffectiveLevel()


def _engine_main(
    build, conn: Connection, cells, stall_s: float, profile: str | None, log_level: int
) -> None:
    """The engine process: build the core, say so, then step it for the server until told to
    stop or the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=env.LOG_FORMAT)
    try:
        core = _build(build)
    except BaseException as e:
        with contextlib.suppress(Exception):
            conn.send(("failed", _picklable(e)))
        raise SystemExit(1) from None
    ready = (
        "ready",
        {
            "tokenizer": core.tokenizer,
            "max_model_len": core.max_model_len,
            "context": core.context,
            "vocab_size": core.vocab_size,
            "checkpoint_path": str(getattr(getattr(core, "checkpoint", None), "path", "")),
            "stats": engine_stats(core),
        },
    )
    try:
        conn.send(ready)
    except OSError:  # the server stopped waiting (Ctrl-C while this loaded): end quietly
        raise SystemExit(1) from None
    sampler = None
    if profile:
        from outrider.server.stack_sampler import StackSampler

        sampler = StackSampler(restart=f"{profile}.engine.restart").start()
    heartbeat = SharedHeartbeat(stall_s, cells)
    hooks = hook_layers(core, heartbeat)
    try:
        _serve(core, conn, heartbeat, min(0.5, stall_s / 4))
    except (EOFError, OSError):
        pass  # the server is gone
    except BaseException as e:
        log.exception("engine process failed")
        with contextlib.suppress(Exception):
            conn.send(("dead", repr(e)))
        raise SystemExit(1) from None
    finally:
        for hook in hooks:
            hook.remove()
        if sampler is not None:
            sampler.stop()
            sampler.write(f"{profile}.engine.txt")


def _build(build):
    if isinstance(build, EngineConfig):
        return load_engine(build)
    return build()


def _serve(core, conn: Connection, heartbeat: Heartbeat, idle_wait_s: float) -> None:
    last_stats = 0.0
    idle_stats_sent = True
    while True:
        heartbeat.beat()
        busy = core.has_unfinished()
        if conn.poll(0 if busy else idle_wait_s):
            while True:
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                _apply_in_engine(core, conn, msg)
                if not conn.poll():
                    break
        if core.has_unfinished():
            heartbeat.step_begin()
            outputs = core.step()
            heartbeat.step_end()
            now = time.monotonic()
            stats = None
            if now - last_stats >= _STATS_EVERY_S or any(o.finished for o in outputs):
                stats, last_stats = engine_stats(core), now
            conn.send(("out", [_wire(o) for o in outputs], stats))
            idle_stats_sent = False
        elif not idle_stats_sent:  # idle: the counters as they ended
            conn.send(("stats", engine_stats(core)))
            idle_stats_sent = True


def _apply_in_engine(core, conn: Connection, msg: tuple) -> None:
    kind = msg[0]
    if kind == "add":
        for rid, ids, params in msg[1]:
            try:
                core.add_request(ids, params, request_id=rid)
            except ValueError as e:  # validated before, so only a race (a duplicate id)
                conn.send(("reject", rid, e))
    elif kind == "abort":
        for rid in msg[1]:
            core.abort(rid)


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
