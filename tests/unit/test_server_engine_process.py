"""EngineProcess: a stand-in engine core stepped in a process of its own. Deltas reach the right
caller, aborts reach the engine process, a failing or vanished engine process fails its callers
and /health, Ctrl-C does not reach it, and a server serves over it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time

import pytest

from outrider.core import SamplingParams
from outrider.server.async_engine import EngineDeadError
from outrider.server.engine_process import EngineProcess
from outrider.testing.server_core import StandInCore

P = SamplingParams(max_tokens=3)


class FailingCore(StandInCore):
    """A stand-in whose step `fail_at` raises (how="raise") or ends its process (how="exit")."""

    def __init__(self, tokens: int, fail_at: int, how: str) -> None:
        super().__init__(tokens)
        self.fail_at, self.how = fail_at, how

    def step(self):
        if self.steps + 1 == self.fail_at:
            if self.how == "exit":
                os._exit(3)
            raise RuntimeError("CUDA error: device lost")
        return super().step()


def _no_model() -> StandInCore:
    raise FileNotFoundError("model.gguf not found: pass a model path")


@contextlib.contextmanager
def running(build):
    engine = EngineProcess(build)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()
        engine.release()


async def _texts(engine, requests) -> dict[int, str]:
    got: dict[int, str] = {}
    async for i, out in engine.generate(requests):
        got[i] = got.get(i, "") + out.text
    return got


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_deltas_reach_their_request_from_another_process():
    with running(functools.partial(StandInCore, 3)) as engine:
        assert engine.pid not in (None, os.getpid())
        got = asyncio.run(_texts(engine, [("a", [1], P), ("b", [1], P)]))
        assert got == {0: "t1t2t3", 1: "t1t2t3"}
        assert engine.num_active == 0 and engine.steps_received >= 3
        # what validation reads came over from the engine process
        assert engine.max_model_len == 64 and engine.vocab_size == 100
        with pytest.raises(ValueError, match="token"):
            engine.validate([100], P)  # beyond the vocabulary


def test_many_requests_arriving_while_it_steps_all_finish():
    """Each request's first delta can come back before the receiver has looked at its queue
    again: every one must still find its caller (none waits forever)."""
    with running(functools.partial(StandInCore, 4)) as engine:
        applied = engine._apply_commands

        def slowly(block: bool) -> None:  # a busy receiver: replies arrive meanwhile
            applied(block)
            time.sleep(0.002)

        engine._apply_commands = slowly

        async def main():
            async def one(i: int) -> str:
                await asyncio.sleep(0.001 * (i % 7))
                return (await _texts(engine, [(f"r{i}", [1], P)]))[0]

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 30)

        assert asyncio.run(main()) == ["t1t2t3t4"] * 200


def test_closing_early_aborts_in_the_engine_process():
    with running(functools.partial(StandInCore, 10**9)) as engine:

        async def main():
            requests = [("a", [1], P), ("b", [1], P)]
            async with contextlib.aclosing(engine.generate(requests)) as gen:
                async for _ in gen:
                    break

        asyncio.run(main())
        # its counters arrive when it goes idle: nothing runs there any more
        assert _wait_for(lambda: engine.stats.num_running == 0)


def test_abort_all_ends_callers_with_abort():
    with running(functools.partial(StandInCore, 10**9)) as engine:

        async def main():
            reasons = []
            async for _, out in engine.generate([("a", [1], P)]):
                if not reasons:
                    engine.abort_all()
                reasons.append(out.finish_reason)
            return reasons

        assert asyncio.run(asyncio.wait_for(main(), 10))[-1] == "abort"
        assert _wait_for(lambda: engine.stats.num_running == 0)


def test_a_duplicate_request_id_is_refused_and_its_namesake_goes_on():
    with running(functools.partial(StandInCore, 10**9)) as engine:

        async def main():
            seen = []

            async def first() -> None:
                async for _, out in engine.generate([("same", [1], P)]):
                    seen.append(out.text)

            task = asyncio.ensure_future(first())
            while not seen:
                await asyncio.sleep(0.01)
            with pytest.raises(ValueError, match="already in use"):
                async for _ in engine.generate([("same", [1], P)]):
                    pass
            before = len(seen)
            for _ in range(500):
                if len(seen) > before + 2:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            return len(seen) > before + 2  # the first request still streams

        assert asyncio.run(main())


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failing_engine_process_fails_its_callers_and_health(how):
    with running(functools.partial(FailingCore, 5, 2, how)) as engine:
        with pytest.raises(EngineDeadError, match="device lost" if how == "raise" else "code 3"):
            asyncio.run(asyncio.wait_for(_texts(engine, [("a", [1], P)]), 10))
        assert _wait_for(lambda: not engine.is_alive)
        with pytest.raises(EngineDeadError):
            asyncio.run(_texts(engine, [("b", [1], P)]))
        assert asyncio.run(engine.probe(timeout=1)) is False


def test_a_core_that_cannot_be_built_raises_its_error_at_start():
    with pytest.raises(FileNotFoundError, match="model.gguf not found"):
        EngineProcess(_no_model)


def test_ctrl_c_does_not_reach_the_engine_process_and_stop_ends_it():
    engine = EngineProcess(functools.partial(StandInCore, 3))
    engine.start()
    try:
        os.kill(engine.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        os.kill(engine.pid, signal.SIGTERM)  # so does systemd's stop (KillMode=control-group)
        time.sleep(0.2)
        assert asyncio.run(_texts(engine, [("a", [1], P)])) == {0: "t1t2t3"}
    finally:
        engine.stop()
        engine.release()
    assert engine._proc.exitcode == 0 and engine.stopped


def test_a_server_serves_over_an_engine_process():
    import httpx

    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    engine = EngineProcess(functools.partial(StandInCore, 3))
    with ServerThread(ServerConfig(served_model_name="standin"), engine) as s:
        r = httpx.post(s.url + "/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t1t2t3"
        health = httpx.get(s.base + "/health").json()
        assert health["status"] == "ok" and health["heartbeat_age_s"] < 5
        r = httpx.post(s.url + "/completions", json={"prompt": [100], "max_tokens": 3})
        assert r.status_code == 400  # validated in the server's process, no round trip
    assert not engine._proc.is_alive()
