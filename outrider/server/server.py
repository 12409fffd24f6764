"""Running the server: start the engine (in a process of its own, server/engine_process.py, or
loaded here and stepped by a thread), serve HTTP with uvicorn, and shut down gracefully.

Shutdown (SIGTERM or SIGINT): admission stops at once (new requests get 503, /health 503, a
request still uploading its body 503 too), systemd hears STOPPING=1, in-flight requests get up
to `shutdown_timeout` seconds to finish, then whatever is left is aborted (its clients get
finish_reason "abort"), uvicorn closes and the process exits 0. A second SIGINT exits at once,
with 130 when that cut requests off. If the engine dies (or its process ends), the server
shuts down and exits 1, for the service manager to restart it. If it is alive but stuck (no
heartbeat within its stall limit), /health says 503 "stalled" and, under a unit with
WatchdogSec=, the WATCHDOG=1 pings stop so that systemd restarts it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from outrider import env
from outrider.config import EngineConfig
from outrider.engine.engine import EngineCore
from outrider.server import sdnotify
from outrider.server.app import build_app
from outrider.server.async_engine import AsyncEngine
from outrider.server.config import ServerConfig
from outrider.server.engine_load import load_engine
from outrider.server.engine_main import Spawned
from outrider.server.engine_process import EngineProcess
from outrider.server.guards import GuardedH11Protocol
from outrider.server.stack_sampler import StackSampler
from outrider.server.state import ServerState, read_chat_template

log = logging.getLogger(__name__)

_ABORT_GRACE_S = 5.0  # after aborting leftovers, time for their last chunks to reach clients
_OWN_FILES = 256  # open files the process needs beside its connections: model, logs, pipes


class OutriderServer(uvicorn.Server):
    """uvicorn.Server with outrider's drain on SIGTERM and sd_notify readiness."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.engine_failed = False
        self.cut_off = False  # a second SIGINT ended requests still in flight
        # Ticked from on_tick, which uvicorn calls only once startup is done: after READY=1,
        # when systemd starts expecting pings.
        self.watchdog = sdnotify.Watchdog.from_env(lambda: state.engine.is_responsive)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.bound_address()
            print(
                f"[outrider] serving {self.state.model_name} on http://{host}:{port}",
                file=sys.stderr,
                flush=True,
            )
            sdnotify.notify(f"READY=1\nSTATUS=serving {self.state.model_name} on port {port}")

    async def on_tick(self, counter: int) -> bool:
        if self.watchdog is not None:
            self.watchdog.tick()
        # A dead engine thread cannot recover in this process: exit non-zero so the service
        # manager (Restart=on-failure) starts a fresh one, instead of answering 503 forever.
        if not self.state.engine.is_alive and not self.engine_failed:
            log.error("the engine thread has stopped (%r): shutting down", self.state.engine.error)
            self.engine_failed = True
            self.state.draining = True
            self.should_exit = True
        return await super().on_tick(counter)

    def bound_address(self) -> tuple[str, int]:
        sock = self.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return host, port

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's: it would re-raise the signal after shutdown, exiting non-zero.
        if self.state.draining:
            if sig == signal.SIGINT:
                self.cut_off = self.state.in_flight > 0
                self.force_exit = self.should_exit = True
            return
        self.begin_drain()

    def begin_drain(self) -> None:
        """Stop admission and drain in a thread (safe from a signal handler or any thread)."""
        self.state.draining = True
        sdnotify.notify("STOPPING=1\nSTATUS=draining")
        threading.Thread(target=self._drain, name="outrider-drain", daemon=True).start()

    def _drain(self) -> None:
        state = self.state
        deadline = time.monotonic() + state.config.shutdown_timeout
        while state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if state.in_flight > 0:
            log.warning(
                "shutdown timeout (%.1f s) reached: aborting %d request(s)",
                state.config.shutdown_timeout,
                state.in_flight,
            )
            state.engine.abort_all()
            grace = time.monotonic() + _ABORT_GRACE_S
            while state.in_flight > 0 and time.monotonic() < grace:
                time.sleep(0.05)
        self.should_exit = True


def model_name(server_config: ServerConfig, engine: AsyncEngine) -> str:
    if server_config.served_model_name:
        return server_config.served_model_name
    path = Path(str(engine.checkpoint.path))
    return path.stem if path.suffix == ".gguf" else path.name


def build_server(
    server_config: ServerConfig, core: EngineCore | AsyncEngine
) -> tuple[OutriderServer, ServerState]:
    """The server over an engine (an EngineProcess, or any AsyncEngine), or over a core it
    steps in a thread of this process."""
    engine = (
        core
        if isinstance(core, AsyncEngine)
        else AsyncEngine(core, stall_s=server_config.health_stall_s)
    )
    state = ServerState.build(engine, server_config, model_name(server_config, engine))
    app = build_app(state, server_config.resolve_api_key())
    # h11 (what uvicorn runs without httptools, which outrider does not install), guarded
    protocol = functools.partial(
        GuardedH11Protocol,
        header_timeout=server_config.header_timeout,
        max_connections=server_config.max_connections,
    )
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        lifespan="off",
        http=protocol,
        timeout_graceful_shutdown=int(_ABORT_GRACE_S),
        access_log=server_config.log_level in ("debug", "info"),
    )
    return OutriderServer(uv_config, state), state


def serve(
    server_config: ServerConfig, engine_config: EngineConfig, spawned: Spawned | None = None
) -> int:
    """Blocks until shutdown; returns the process exit code. `spawned`: the engine process,
    already started on engine_config (`outrider serve` starts it first: engine_main.spawn); it is
    started here when the config asks for one and none is given."""
    api_key = server_config.resolve_api_key()  # fail on a bad key file before loading a model
    if api_key is None and server_config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "serving on %s without an API key: anyone who reaches it can use it", server_config.host
        )
    if server_config.chat_template is not None:  # a typo in it fails before a model loads
        read_chat_template(server_config.chat_template)
    open_files_for(server_config.max_connections + _OWN_FILES)
    if server_config.engine_process:
        engine = EngineProcess(spawned or engine_config, stall_s=server_config.health_stall_s)
    else:
        engine = AsyncEngine(load_engine(engine_config), stall_s=server_config.health_stall_s)
    server, state = build_server(server_config, engine)
    profile = env.thread_profile()
    sampler = StackSampler(restart=f"{profile}.restart").start() if profile else None
    state.engine.start()
    try:
        server.run()
    finally:
        state.offload.close()
        state.engine.stop()
        if sampler is not None:
            sampler.stop()
            sampler.write(profile)
    return 1 if server.engine_failed else 130 if server.cut_off else 0


def open_files_for(needed: int) -> None:
    """Raise the soft limit on open files to `needed` (at most the hard limit): each connection
    is one, and at the limit new ones fail in accept() before any request can be refused. Many
    systems start processes at 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < needed:
        log.warning(
            "open files are limited to %d (hard limit), below the %d that max_connections needs: "
            "raise the limit (LimitNOFILE= in the unit, ulimit -Hn) or lower max_connections",
            raised,
            needed,
        )


class ServerThread:
    """A server on 127.0.0.1 and a free port, in a background thread (tests, notebooks).

    with ServerThread(ServerConfig(api_key="k"), core) as s: openai.OpenAI(base_url=s.url, ...)
    """

    def __init__(self, server_config: ServerConfig, core: EngineCore) -> None:
        self.server, self.state = build_server(server_config.replace(host="127.0.0.1"), core)
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without
        # it every streamed chunk after the first waits ~40 ms (Nagle and delayed ACKs).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.base = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._run, name="outrider-http", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self._sock]))

    def __enter__(self) -> ServerThread:
        self.state.engine.start()
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start within 30 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.state.offload.close()
        self.state.engine.stop()
        if self.state.engine.stopped:  # (a step stuck past stop's wait keeps its core)
            self.state.engine.release()
        self._sock.close()
