"""A KV pool far too small for the load: four times the work it holds completes through
preemption, and /health and /metrics report what happened."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


NUM_BLOCKS = 4  # x 16 tokens: 64 token slots, a small fraction of what the tests ask for


@pytest.fixture(scope="module")
def server():
    from outrider.config import EngineConfig
    from outrider.engine.engine import EngineCore
    from outrider.server.config import ServerConfig
    from outrider.server.server import ServerThread

    core = EngineCore(
        EngineConfig().replace(
            model={"dtype": "float32", "device": "cpu"},
            cache={"num_blocks": NUM_BLOCKS, "block_size": 16},
            scheduler={"max_num_seqs": 16},
        )
    )
    with ServerThread(ServerConfig(), core) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _wait_idle(server, timeout: float = 20.0):
    """Until the engine holds no request; returns its last stats snapshot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.state.engine.stats
        if stats.num_running == stats.num_waiting == 0 and server.state.engine.num_active == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine is still busy after {timeout} s: {server.state.engine.stats}")


def _metric(server, name: str) -> float:
    text = httpx.get(server.base + "/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_four_times_the_kv_pool_completes_by_preemption(server):
    """8 requests of ~25 tokens (2 blocks) each need 16 blocks at once; the pool has 4."""
    preempted_before = _metric(server, "outrider:num_preemptions_total")
    max_tokens = 20

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            bodies = [
                {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "ignore_eos": True}
                for i in range(8)
            ]
            responses = await asyncio.gather(*(c.post("/completions", json=b) for b in bodies))
        return [r.json() for r in responses]

    results = asyncio.run(run())
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in results]
    need_blocks = sum(-(-(p + max_tokens) // 16) for p in prompt_tokens)
    assert need_blocks >= 4 * NUM_BLOCKS
    for r in results:
        assert "error" not in r, r
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == max_tokens
    assert _metric(server, "outrider:num_preemptions_total") > preempted_before
    assert _wait_idle(server).num_free_blocks == NUM_BLOCKS


def test_health_reads_the_heartbeat_without_probing(server):
    r = httpx.get(server.base + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    server.state.engine.last_step_time -= 60  # idle for a minute: the idle loop still beats
    r = httpx.get(server.base + "/health")
    assert r.status_code == 200 and r.json()["heartbeat_age_s"] < 1


def test_metrics_count_tokens_and_latencies(server, client):
    before = _metric(server, "outrider:generation_tokens_total")
    client.completions.create(model=server.state.model_name, prompt="Hi", max_tokens=4)
    assert _metric(server, "outrider:generation_tokens_total") == before + 4
    for name in (
        "outrider:prompt_tokens_total",
        "outrider:time_to_first_token_seconds_count",
        "outrider:inter_token_latency_seconds_count",
        "outrider:e2e_request_latency_seconds_count",
        "outrider:request_success_total",
    ):
        assert _metric(server, name) > 0, name
    text = httpx.get(server.base + "/metrics").text
    for name in (
        "outrider:num_requests_running",
        "outrider:num_requests_waiting",
        "outrider:spec_decode_num_drafts_total",
        "outrider:spec_decode_num_draft_tokens_total",
        "outrider:spec_decode_num_accepted_tokens_total",
    ):
        assert name in text, name
