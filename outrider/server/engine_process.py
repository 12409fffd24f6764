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
its text), so a bad one gets its 400 without a round trip. The engine process's side is
server/engine_main.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from types import SimpleNamespace

from outrider.config import EngineConfig
from outrider.core import RequestOutput, SamplingParams
from outrider.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    SharedHeartbeat,
    _aborted,
    _Sink,
)
from outrider.server.config import ServerConfig
from outrider.server.engine_main import Spawned, spawn

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 3600.0  # building a large model's engine (loading, capturing graphs)
_JOIN_S = 10.0  # at stop, the engine process gets this long to end before it is terminated


class EngineProcess(AsyncEngine):
    """AsyncEngine's surface over an engine core built and stepped in another process.

    `build` is what the engine process calls to make its core: an EngineConfig (the server's
    load_engine: built, then warmed up) or any picklable callable returning an object with
    EngineCore's surface (tests: outrider.testing.server_core.StandInCore); or the engine
    process `engine_main.spawn` started on one. Construction returns once the core is built;
    its error, if building fails, is raised here."""

    def __init__(
        self,
        build: EngineConfig | Callable[[], object] | Spawned,
        observer=None,
        stall_s: float = ServerConfig.health_stall_s,
    ) -> None:
        spawned = build if isinstance(build, Spawned) else spawn(build, stall_s)
        self._spawned = spawned
        self._proc, self._conn = spawned.proc, spawned.conn
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
        self.heartbeat = SharedHeartbeat(spawned.stall_s, spawned.cells)
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
            self._spawned.kill()
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
                raise payload  # ("failed", the exception); the process exits by itself
            if not self._proc.is_alive():
                break
        self._proc.join(_JOIN_S)  # its exit code, once it has ended
        if self._proc.is_alive():  # (killed on the way out)
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


def _output(d: tuple) -> RequestOutput:
    """What engine_main.wire made of a RequestOutput, as one again."""
    rid, text, ids, finished, reason, metrics, logprobs, completions = d
    return RequestOutput(rid, None, [], text, ids, finished, reason, metrics, logprobs, completions)
