"""Requests that end early: streams closed mid-generation and dropped non-streaming requests
are aborted in the engine and give back every KV block they held; the server keeps answering.
The engine speculates (n-gram), so the speculative-decoding metrics are checked here too."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.e2e.test_server_lifecycle import _metric, _wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    core = EngineCore(
        EngineConfig().replace(
            model={"dtype": "float32", "device": "cpu"},
            cache={"cpu_kv_bytes": 64 << 20},
            scheduler={"max_num_seqs": 64},
            speculative={"method": "ngram", "controller": "fixed", "num_draft_tokens": 4},
        )
    )
    with ServerThread(ServerConfig(), core) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


async def _aborted_streams(server, count: int, concurrency: int) -> int:
    """Open `count` streams that each read one content chunk, then hang up; returns how many
    saw content before hanging up."""
    # A one-word prompt: the cost per stream is then a token or two of compute, not a prefill.
    body = {"prompt": "Once", "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    gate = asyncio.Semaphore(concurrency)
    saw = 0

    async def one(c: httpx.AsyncClient) -> None:
        nonlocal saw
        async with gate, c.stream("POST", "/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text": ""' not in line:
                    saw += 1
                    break  # leaving the block closes the connection mid-generation

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
        await asyncio.gather(*(one(c) for _ in range(count)))
    return saw


def _check_aborts(server, client, count: int, concurrency: int) -> None:
    initial = _wait_idle(server).num_free_blocks
    assert initial == server.state.engine.stats.num_blocks
    saw = asyncio.run(_aborted_streams(server, count, concurrency))
    assert saw == count
    stats = _wait_idle(server)
    assert stats.num_free_blocks == initial, stats
    assert _metric(server, "outrider:num_free_kv_blocks") == initial
    assert _metric(server, "outrider:kv_cache_usage_perc") == 0.0
    # Aborted requests never finish: at most the few that ran to 200 tokens could be counted.
    r = client.completions.create(model=server.state.model_name, prompt="Hello", max_tokens=3)
    assert r.usage.completion_tokens == 3  # and the server still answers


def test_aborted_streams_free_their_kv(server, client):
    _check_aborts(server, client, count=24, concurrency=8)


def test_a_thousand_aborted_streams_free_their_kv(server, client):
    _check_aborts(server, client, count=1000, concurrency=32)


def test_dropped_non_streaming_request_is_aborted(server, client):
    initial = _wait_idle(server).num_free_blocks
    finished_before = _metric(server, "outrider:request_success_total")
    body = {"prompt": "Write a very long essay.", "max_tokens": 50, "ignore_eos": True}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/completions", json=body, timeout=0.5)
    # The engine notices the closed connection and aborts long before 50 tokens are done.
    stats = _wait_idle(server, timeout=10)
    assert time.monotonic() - t0 < 8.0
    assert stats.num_free_blocks == initial
    # Aborted, not finished: a request that ran to its end would be counted here.
    assert _metric(server, "outrider:request_success_total") == finished_before


def test_speculative_metrics_follow_the_engine(server, client):
    names = (
        "outrider:spec_decode_num_drafts_total",
        "outrider:spec_decode_num_draft_tokens_total",
        "outrider:spec_decode_num_accepted_tokens_total",
    )
    before = [_metric(server, n) for n in names]
    prompt = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on"
    r = client.completions.create(
        model=server.state.model_name, prompt=prompt, max_tokens=24, temperature=0
    )
    assert r.usage.completion_tokens > 0
    drafts, draft_tokens, accepted = (_metric(server, n) - b for n, b in zip(names, before))
    spec = server.state.engine.core.speculator.stats
    assert drafts > 0 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
    assert _metric(server, names[1]) == spec.num_draft_tokens
    per_pos = _metric(server, "outrider:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == spec.num_accepted_tokens  # each accepted draft sits at one position
    core = server.state.engine.core
    steps = _metric(server, "outrider:spec_decode_steps_total")
    assert steps == sum(core.speculator.steps_by_k.values()) and steps > 0
    assert _metric(server, "outrider:spec_decode_k") == core.speculator.last_k
