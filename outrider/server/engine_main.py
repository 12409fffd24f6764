"""The engine process's side of EngineProcess (server/engine_process.py): started first, stepping
the engine for the server until told to stop.

Importing this module costs nothing (the engine's modules load inside the engine process), so
`outrider serve` starts the engine process (`spawn`) before it imports the server's own modules:
on 2 cores the two processes' imports, about 2 s each, then overlap.

The engine process ignores SIGINT and SIGTERM (a terminal's Ctrl-C and systemd's stop reach
every process of the group): it ends on the server's "stop", or when the server's end of the
pipe closes (the server died), and never outlives it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from outrider.env import LOG_FORMAT, thread_profile

log = logging.getLogger(__name__)

_STATS_EVERY_S = 0.02  # the engine process sends its counters at most this often while busy


@dataclass
class Spawned:
    """An engine process started, and the server's ends of what ties it to the server."""

    proc: multiprocessing.process.BaseProcess
    conn: Connection  # the pipe: commands there, deltas and counters back
    cells: object  # RawArray("d", 2): the heartbeat's last beat and stall limit, shared
    stall_s: float

    def kill(self) -> None:
        """End it now (it ignores SIGINT and SIGTERM): the server failed before it served."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()


def spawn(build, stall_s: float) -> Spawned:
    """Start the engine process on `build` (an EngineConfig, or a picklable callable returning a
    core: see EngineProcess) and return at once; it logs at this process's level."""
    ctx = multiprocessing.get_context("spawn")  # CUDA is initialised in the child alone
    cells = ctx.RawArray("d", 2)
    cells[0], cells[1] = time.monotonic(), stall_s
    conn, child_conn = ctx.Pipe()
    level = logging.getLogger().getEffectiveLevel()
    proc = ctx.Process(
        target=engine_main,
        args=(build, child_conn, cells, stall_s, thread_profile(), level),
        name="outrider-engine",
    )
    proc.start()
    child_conn.close()
    return Spawned(proc, conn, cells, stall_s)


def wire(out) -> tuple:
    """A RequestOutput as the pipe carries it: a tuple, the prompt left out (the server never
    reads it back; EngineProcess's `_output` makes it a RequestOutput again)."""
    return (
        out.request_id, out.text, out.token_ids, out.finished, out.finish_reason,
        out.metrics, out.logprobs, out.completions,
    )  # fmt: skip


def engine_main(
    build, conn: Connection, cells, stall_s: float, profile: str | None, log_level: int
) -> None:
    """The engine process: build the core, say so, then step it for the server until told to
    stop or the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        core = _build(build)
        from outrider.server.async_engine import (
            SharedHeartbeat,
            engine_stats,
            hook_layers,
            log_speculation,
        )
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
        log_speculation(core)
        if sampler is not None:
            sampler.stop()
            sampler.write(f"{profile}.engine.txt")


def _build(build):
    from outrider.config import EngineConfig

    if isinstance(build, EngineConfig):
        from outrider.server.engine_load import load_engine

        return load_engine(build)
    return build()


def _serve(core, conn: Connection, heartbeat, idle_wait_s: float) -> None:
    from outrider.server.async_engine import engine_stats

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
            conn.send(("out", [wire(o) for o in outputs], stats))
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
