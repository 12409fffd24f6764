"""AsyncEngine against a scripted stand-in for EngineCore: deltas reach the right caller, an
early close aborts in the engine thread, a failing engine fails its callers and /health."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from outrider.core import RequestOutput, SamplingParams
from outrider.server.async_engine import AsyncEngine, EngineDeadError, merged
from outrider.testing.server_core import StandInCore


class FakeCore(StandInCore):
    """StandInCore (each request emits `tokens` one-token deltas, one per step, then finishes)
    that remembers the threads calling it and the requests it aborted, and can fail at a step."""

    def __init__(self, tokens: int = 3, fail_at_step: int | None = None) -> None:
        super().__init__(tokens)
        self.fail_at_step = fail_at_step
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()

    def add_request(self, ids, params, request_id=None):
        self.thread_ids.add(threading.get_ident())
        super().add_request(ids, params, request_id)

    def abort(self, request_id) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self.live:
            self.aborted.append(request_id)
        super().abort(request_id)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.steps + 1 == self.fail_at_step:
            self.steps += 1
            raise RuntimeError("CUDA error: device lost")
        return super().step()


@contextlib.contextmanager
def running(core):
    engine = AsyncEngine(core)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


P = SamplingParams(max_tokens=3)


def test_deltas_reach_their_request_in_order():
    core = FakeCore(tokens=3)

    async def main():
        got: dict[int, list[str]] = {0: [], 1: []}
        async for i, out in engine.generate([("a", [1], P), ("b", [1], P)]):
            got[i].append(out.text)
        return got

    with running(core) as engine:
        got = asyncio.run(main())
        # (deltas queued together arrive as one: test_deltas_queued_together_arrive_as_one)
        assert {i: "".join(texts) for i, texts in got.items()} == {0: "t1t2t3", 1: "t1t2t3"}
        assert engine.num_active == 0
    # Only the engine thread touched the core.
    assert len(core.thread_ids) == 1 and threading.get_ident() not in core.thread_ids


def test_deltas_queued_together_arrive_as_one():
    """A caller behind the engine (the event loop busy elsewhere) takes every delta queued for
    a request at once, merged: text, tokens and logprobs joined, the last one's finish; the
    other request's deltas keep their order and stay apart."""
    core = FakeCore(tokens=6)

    async def main():
        got: list[tuple[int, str, list[int], bool]] = []
        async for i, out in engine.generate([("a", [1], P), ("b", [1], P)]):
            got.append((i, out.text, out.token_ids, out.finished))
            if len(got) == 1:
                await asyncio.sleep(0.2)  # the engine runs on: every other delta queues
        return got

    with running(core) as engine:
        got = asyncio.run(main())
    for i in (0, 1):
        mine = [g for g in got if g[0] == i]
        assert "".join(t for _, t, _, _ in mine) == "t1t2t3t4t5t6"
        assert sum(len(ids) for _, _, ids, _ in mine) == 6
        assert [f for *_, f in mine] == [False] * (len(mine) - 1) + [True]
    assert len(got) < 12, got  # merged: fewer deltas than steps


def test_merged_deltas_join_logprobs_and_keep_the_last_state():
    a = RequestOutput("r", None, [1], "ab", [5, 6], False, None, {"x": 1}, [{5: -0.1}, {6: -0.2}])
    b = RequestOutput("r", None, [1], "c", [7], True, "stop", {"x": 2}, [{7: -0.3}])
    m = merged(a, b)
    assert (m.text, m.token_ids, m.finished, m.finish_reason) == ("abc", [5, 6, 7], True, "stop")
    assert m.logprobs == [{5: -0.1}, {6: -0.2}, {7: -0.3}] and m.metrics == {"x": 2}
    plain = merged(RequestOutput("r", None, [1], "a", [5], False, None, {}), b)
    assert plain.logprobs == [{}, {7: -0.3}]  # one entry a token


def test_closing_early_aborts_in_the_engine():
    core = FakeCore(tokens=1000)

    async def main():
        async with contextlib.aclosing(engine.generate([("a", [1], P), ("b", [1], P)])) as gen:
            async for _ in gen:
                break

    with running(core) as engine:
        asyncio.run(main())
        for _ in range(500):  # up to 10 s: a loaded 2-core machine took more than 2
            if sorted(core.aborted) == ["a", "b"]:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert sorted(core.aborted) == ["a", "b"] and not core.live


def test_abort_all_ends_callers_with_abort():
    core = FakeCore(tokens=10**9)

    async def main():
        reasons = []
        async for _, out in engine.generate([("a", [1], P)]):
            if len(reasons) == 0:
                engine.abort_all()
            reasons.append(out.finish_reason)
        return reasons

    with running(core) as engine:
        reasons = asyncio.run(asyncio.wait_for(main(), 10))
    assert reasons[-1] == "abort" and core.aborted == ["a"]


def test_a_failing_engine_fails_callers_and_health():
    core = FakeCore(tokens=5, fail_at_step=2)

    async def main():
        async for _ in engine.generate([("a", [1], P)]):
            pass

    with running(core) as engine:
        with pytest.raises(EngineDeadError, match="device lost"):
            asyncio.run(asyncio.wait_for(main(), 10))
        assert not engine.is_alive and "device lost" in repr(engine.error)
        with pytest.raises(EngineDeadError):
            asyncio.run(main())
        assert asyncio.run(engine.probe(timeout=1)) is False


def test_probe_produces_a_token():
    with running(FakeCore(tokens=1)) as engine:
        assert asyncio.run(engine.probe(timeout=5)) is True


def test_a_dead_engine_gets_503_and_stops_the_server():
    import time

    import httpx

    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    s = ServerThread(ServerConfig(served_model_name="fake"), FakeCore(fail_at_step=1))
    with s:
        r = httpx.post(s.url + "/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while not s.server.should_exit and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.server.engine_failed and s.state.draining  # serve() then exits 1


def test_a_server_thread_lets_go_of_its_engine_core_when_it_exits():
    """Once a ServerThread has exited, nothing of the server holds its engine core (FastAPI
    caches a server's endpoints, which close over its state, for the life of the process):
    the caller's references alone decide when the core goes."""
    import gc
    import weakref

    import httpx

    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    core = FakeCore()
    gone = weakref.ref(core)
    with ServerThread(ServerConfig(served_model_name="fake"), core) as s:
        r = httpx.post(s.url + "/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200
    assert s.state.engine.stopped and s.state.engine.core is None
    del core
    gc.collect()
    assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    with pytest.raises(RuntimeError, match="stop"):
        running_engine = AsyncEngine(FakeCore())
        running_engine.start()
        try:
            running_engine.release()
        finally:
            running_engine.stop()


def test_an_engine_with_speculation_says_what_it_did_as_it_stops(caplog):
    from types import SimpleNamespace

    from outrider.server.async_engine import SPECULATION_SUMMARY
    from outrider.speculative.stats import SpecStats

    core = FakeCore(tokens=3)
    core.speculator = SimpleNamespace(
        summary=lambda: "decode steps k=0: 5, k=3: 2", stats=SpecStats(), last_k=0, steps_by_k={}
    )
    with caplog.at_level("WARNING", logger="outrider.server.async_engine"), running(core):
        pass
    said = [r.getMessage() for r in caplog.records if SPECULATION_SUMMARY in r.getMessage()]
    assert said == [SPECULATION_SUMMARY + "decode steps k=0: 5, k=3: 2"]
