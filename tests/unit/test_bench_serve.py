"""`outrider bench serve` and `bench plot` against a fake OpenAI-compatible server whose prompts
say how to answer ("ttft=0.05 itl=0.01 n=6"): the measured TTFT, TPOT, ITL, e2e latency and
throughput must match the latencies injected, within tolerances a wrong definition breaks."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from outrider.bench.prompts import Prompt, arrival_times, file_prompts, load_prompts
from outrider.bench.request import RequestResult, sse_lines
from outrider.bench.serve import BenchConfig, BenchError, run, summarize
from outrider.bench.stats import (
    accept_summary,
    parse_prometheus,
    percentile,
    spec_counters,
    spec_delta,
    tp_counters,
    tp_delta,
)
from outrider.cli import main

# Per request the fake server adds this to its speculative counters.
DRAFTS, DRAFT_TOKENS, ACCEPTED = 4, 12, 6


class FakeServer:
    """A streaming /v1/completions and /v1/chat/completions (plus /v1/models and /metrics).
    The prompt's words set the answer: ttft=S and itl=S (seconds), n=N tokens, per_chunk=K
    tokens per SSE chunk, `fail` (HTTP 500), `nousage` (no usage chunk). /fake/state and
    /fake/reset let the test read and reset what it counted."""

    def __init__(self) -> None:
        self.generation = 0
        self.reset({"metrics_prefix": "outrider:"})

    def reset(self, options: dict) -> None:
        # Requests still running from an earlier test (cancelled by a time limit) belong to an
        # older generation and leave the new counts alone.
        self.generation += 1
        self.metrics_prefix = options["metrics_prefix"]  # None: /metrics is 404
        self.counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.in_flight = self.max_in_flight = 0
        self.auth: set[str | None] = set()

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if path == "/fake/reset":
            self.reset(json.loads(body))
            return await _json(send, 200, {})
        if path == "/fake/state":
            state = {k: getattr(self, k) for k in ("counters", "in_flight", "max_in_flight")}
            return await _json(send, 200, {**state, "auth": sorted(self.auth, key=str)})
        self.auth.add(dict(scope["headers"]).get(b"authorization", b"").decode() or None)
        if path == "/v1/models":
            return await _json(send, 200, {"object": "list", "data": [{"id": "fake-model"}]})
        if path == "/metrics":
            if self.metrics_prefix is None:
                return await _json(send, 404, {"detail": "Not Found"})
            return await _text(send, self._metrics())
        req = json.loads(body)
        text = req["prompt"] if "prompt" in req else req["messages"][0]["content"]
        if "fail" in text.split():
            return await _json(send, 500, {"error": {"message": "injected failure"}})
        generation = self.generation
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._stream(send, path, req, text)
            if generation == self.generation:
                for name, add in zip(self.counters, (DRAFTS, DRAFT_TOKENS, ACCEPTED)):
                    self.counters[name] += add
        finally:
            if generation == self.generation:
                self.in_flight -= 1

    async def _stream(self, send, path: str, req: dict, text: str) -> None:
        opts = dict(w.split("=") for w in text.split() if "=" in w)
        n, per_chunk = int(opts.get("n", 4)), int(opts.get("per_chunk", 1))
        raw = "raw" in text.split()
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.sleep(float(opts.get("ttft", 0.01)))
        for i in range(n // per_chunk):
            if i:
                await asyncio.sleep(float(opts.get("itl", 0.01)))
            words = ("t\u2028o\x85k " if raw else "tok ") * per_chunk
            chat = path.endswith("/chat/completions")
            choice = {"delta": {"content": words}} if chat else {"text": words}
            await _event(send, {"choices": [{"index": 0, **choice}]}, raw)
        if req.get("stream_options", {}).get("include_usage") and "nousage" not in text.split():
            usage = {"prompt_tokens": len(text.split()), "completion_tokens": n}
            await _event(send, {"choices": [], "usage": usage}, raw)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def _metrics(self) -> str:
        p = self.metrics_prefix
        lines = ["# HELP some_other_total Not ours.", "some_other_total 7.0"]
        for name, value in self.counters.items():
            lines += [
                f"# TYPE {p}spec_decode_{name} counter",
                # Two label sets, summed by the reader (one has a space in its value).
                f'{p}spec_decode_{name}_total{{model_name="fake model"}} {value - 1}.0',
                f'{p}spec_decode_{name}_total{{model_name="b"}} 1.0',
                f'{p}spec_decode_{name}_created{{model_name="b"}} 1.7e9',
            ]
        return "\n".join(lines) + "\n"


async def _event(send, obj: dict, raw: bool = False) -> None:
    if not raw:
        data = f"data: {json.dumps(obj)}\n\n".encode()
        await send({"type": "http.response.body", "body": data, "more_body": True})
        return
    # As vLLM and SGLang write it: U+2028 and U+0085 left raw in the JSON; here also CRLF line
    # ends and each event sent in two pieces, the cut inside its text and inside its CRLF.
    data = f"data: {json.dumps(obj, ensure_ascii=False)}\r\n\r\n".encode()
    for part in (data[: data.find(b"\x85") + 1], data[data.find(b"\x85") + 1 : -3], data[-3:]):
        await send({"type": "http.response.body", "body": part, "more_body": True})


async def _json(send, status: int, obj: dict) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


async def _text(send, text: str) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4")]})  # fmt: skip
    await send({"type": "http.response.body", "body": text.encode()})


def serve_fake() -> None:
    """Run FakeServer on a free loopback port, printed on stdout (the fixture's subprocess)."""
    import uvicorn

    # IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY on accepted connections only
    # for sockets that say TCP, and without it each chunk after the first waits ~40 ms for
    # the client's delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(FakeServer(), lifespan="off", log_level="error")).run([sock])


class Fake:
    """The test's handle on the fake server: its URL, what it counted, a reset."""

    def __init__(self, url: str) -> None:
        self.url = url

    def state(self) -> dict:
        return httpx.get(self.url + "/fake/state").json()

    def reset(self, metrics_prefix: str | None = "outrider:") -> None:
        r = httpx.post(self.url + "/fake/reset", json={"metrics_prefix": metrics_prefix})
        r.raise_for_status()


@pytest.fixture(scope="module")
def _served():
    # Its own process, as a real server is: in this one it would share the GIL with the
    # client and add its CPU time to every latency measured.
    code = "from tests.unit.test_bench_serve import serve_fake; serve_fake()"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        fake = Fake(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 20
        while True:
            try:
                fake.state()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "no fake server"
                time.sleep(0.05)
        yield fake
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture()
def fake(_served):
    _served.reset()
    return _served


def _cfg(fake, **kw) -> BenchConfig:
    return BenchConfig(base_url=fake.url + "/v1", **{"max_concurrency": (1,), **kw})


def _point(fake, prompts: list[str], **kw) -> dict:
    result = run(_cfg(fake, **kw), [Prompt(p, 16) for p in prompts], progress=False)
    assert len(result["points"]) == 1
    return result["points"][0]


# -- latencies, throughput and goodput against what the server injected ----------------------


def test_ttft_itl_tpot_e2e_percentiles_match_injected_latencies(fake):
    # TTFT 20, 40, ..., 200 ms, then 5 more tokens 10 ms apart; one request at a time.
    prompts = [f"ttft={0.02 * k:.2f} itl=0.01 n=6" for k in range(1, 11)]
    p = _point(fake, prompts, max_concurrency=(1,))
    assert (p["completed"], p["failed"], p["incomplete"]) == (10, 0, 0)
    assert fake.state()["max_in_flight"] == 1
    # numpy's percentiles of 20..200 step 20: median 110, p90 182, p99 198.2, plus each
    # request's overhead (a few ms). From the point's start instead of each request's own
    # send, the last TTFT would be ~1.5 s.
    for key, want in [("median", 110), ("p50", 110), ("p90", 182), ("p99", 198.2), ("mean", 110)]:
        assert want - 0.5 <= p[f"{key}_ttft_ms"] <= want + 30, (key, p[f"{key}_ttft_ms"])
    assert 72 - 12 <= p["p90_ttft_ms"] - p["median_ttft_ms"] <= 72 + 12  # a shared overhead cancels
    assert 50 <= p["std_ttft_ms"] <= 65  # pstdev of 20..200 step 20 = 57.4
    assert 8 <= p["mean_itl_ms"] <= 16 and 8 <= p["median_itl_ms"] <= 16
    assert 9.5 <= p["mean_tpot_ms"] <= 16  # 50 ms over the 5 tokens after the first
    assert 159.5 <= p["median_e2el_ms"] <= 200  # TTFT + 50 ms
    assert p["total_output_tokens"] == 60  # the server's usage
    assert p["total_input_tokens"] == 30  # 3 words per prompt, by the fake's usage
    assert 1.6 <= p["duration"] <= 2.1  # the sum of the ten requests' latencies
    assert p["output_throughput"] == pytest.approx(60 / p["duration"])
    assert p["request_throughput"] == pytest.approx(10 / p["duration"])
    assert p["total_token_throughput"] == pytest.approx(90 / p["duration"])
    assert p["request_goodput"] is None and p["good_completed"] is None  # no SLO given


def test_goodput_counts_requests_within_every_slo(fake):
    fast = "ttft=0.01 itl=0.005 n=5"  # TPOT ~5 ms
    slow_first = "ttft=0.15 itl=0.005 n=5"  # misses the TTFT SLO
    slow_tokens = "ttft=0.01 itl=0.05 n=3"  # TPOT ~50 ms: misses the TPOT SLO
    prompts = [fast, slow_first, fast, slow_tokens]
    p = _point(fake, prompts, max_concurrency=(1,), slo_ttft_ms=80, slo_tpot_ms=25)
    assert p["completed"] == 4 and p["good_completed"] == 2
    assert p["request_goodput"] == pytest.approx(2 / p["duration"])


def test_concurrent_requests_overlap_up_to_the_limit(fake):
    # 8 requests of ~80 ms, 4 at a time: two waves, not eight.
    p = _point(fake, ["ttft=0.05 itl=0.01 n=4"] * 8, max_concurrency=(4,))
    assert p["completed"] == 8 and fake.state()["max_in_flight"] == 4
    assert 0.16 <= p["duration"] <= 0.4
    assert 50 <= p["median_ttft_ms"] <= 100 and 79.5 <= p["median_e2el_ms"] <= 150
    assert p["output_throughput"] == pytest.approx(32 / p["duration"])


def test_multi_token_chunks_count_usage_tokens_and_chunks_without_usage(fake):
    # Two chunks of two tokens, 60 ms apart: a speculative server's stream.
    p = _point(fake, ["ttft=0.02 itl=0.06 n=4 per_chunk=2"] * 2)
    assert p["total_output_tokens"] == 8
    assert 50 <= p["mean_itl_ms"] <= 100  # between chunks (per token it would be 30)
    assert 18 <= p["mean_tpot_ms"] <= 35  # 60 ms over the 3 tokens after the first
    # Without usage, one token per chunk, and no input token count.
    p = _point(fake, ["ttft=0.02 itl=0.06 n=4 per_chunk=2 nousage"] * 2)
    assert p["total_output_tokens"] == 4
    assert 55 <= p["mean_tpot_ms"] <= 100  # 60 ms over one more "token"
    assert p["total_input_tokens"] is None and p["total_token_throughput"] is None


def test_raw_line_separators_crlf_and_split_events_read_as_one_event(fake):
    # str.splitlines would cut each event at U+2028 and U+0085 into invalid JSON.
    p = _point(fake, ["ttft=0.01 itl=0.01 n=4 raw"] * 3, endpoint="chat")
    assert (p["completed"], p["failed"]) == (3, 0), p["errors"]
    assert p["total_output_tokens"] == 12 and p["total_input_tokens"] == 12


@pytest.mark.parametrize("text", ["a\r\n\r\nb\rc\n\nd\u2028e\x85f\r", "x\n\r\n\ry", "\r\r\n"])
def test_sse_lines_break_at_crlf_lf_and_cr_only_wherever_the_chunks_end(text):
    want = re.split(r"\r\n|\r|\n", text)
    want = want[:-1] if want[-1] == "" else want
    for cuts in [(), *((i,) for i in range(1, len(text))), (1, 2, 3, 4, 5)]:
        bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
        chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]

        assert asyncio.run(_read_sse(chunks)) == want, (chunks, want)


async def _read_sse(chunks: list[str]) -> list[str]:
    class Response:
        async def aiter_text(self):
            for c in chunks:
                yield c

    return [line async for line in sse_lines(Response())]


def test_failed_requests_are_counted_apart_from_the_latencies(fake):
    ok, bad = "ttft=0.03 itl=0.01 n=3", "fail"
    p = _point(fake, [ok, bad, ok, bad, ok, ok], max_concurrency=(2,), endpoint="completions")
    assert (p["completed"], p["failed"]) == (4, 2)
    assert p["errors"] == {"HTTP 500: injected failure": 2}
    # 50 ms each, the failures (no latency at all) left out: with them the mean would be 33.
    assert 49.5 <= p["mean_e2el_ms"] <= 100 and 49.5 <= p["p50_e2el_ms"] <= 100
    assert p["total_output_tokens"] == 12


def test_concurrency_bounds_requests_in_flight_at_each_point(fake):
    seen = []

    def on_point(point):
        seen.append((point["max_concurrency"], fake.state()["max_in_flight"]))
        fake.reset()

    cfg = _cfg(fake, max_concurrency=(2, 3))
    result = run(cfg, [Prompt("ttft=0.05 n=2", 8)] * 6, on_point=on_point, progress=False)
    assert seen == [(2, 2), (3, 3)]
    assert [p["completed"] for p in result["points"]] == [6, 6]


def test_client_processes_share_the_streams_and_the_prompts(fake):
    # 12 requests of ~80 ms, 6 streams from 3 processes of 2: two waves of 6 in flight.
    p = _point(fake, [f"ttft=0.05 itl=0.01 n=4 k={i}" for i in range(12)], max_concurrency=(6,),
               client_processes=3)  # fmt: skip
    assert p["client_processes"] == 3
    assert (p["completed"], p["failed"], p["incomplete"]) == (12, 0, 0)
    assert fake.state()["max_in_flight"] == 6
    assert p["total_output_tokens"] == 48 and len(p["errors"]) == 0
    # Timed from the processes' common start (their spawn and imports before it): two waves.
    assert 0.16 <= p["duration"] <= 0.6
    assert 50 <= p["median_ttft_ms"] <= 150 and 79.5 <= p["median_e2el_ms"] <= 250


def test_client_processes_default_to_one_per_16_streams_within_half_the_cores(monkeypatch):
    cfg = BenchConfig(base_url="http://127.0.0.1:9")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert [cfg.client_processes_at(c) for c in (1, 16, 17, 64, 256)] == [1, 1, 2, 4, 8]
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # a 2-core machine: one process
    assert cfg.client_processes_at(64) == 1
    given = BenchConfig(base_url="http://127.0.0.1:9", client_processes=3)
    assert [given.client_processes_at(c) for c in (1, 2, 64)] == [1, 2, 3]


def test_time_limit_cancels_what_is_still_running(fake):
    # ~0.3 s per request, one at a time, 0.75 s allowed: two finish, the third is cancelled.
    p = _point(fake, ["ttft=0.28 itl=0.02 n=2"] * 5, max_concurrency=(1,), time_limit_s=0.75)
    assert p["time_limited"] is True
    assert (p["completed"], p["failed"], p["incomplete"]) == (2, 0, 3)
    assert 0.74 <= p["duration"] <= 0.95


# -- accept length from /metrics ---------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["outrider:", "vllm:"])
def test_accept_length_is_the_metrics_difference_over_each_point(fake, prefix):
    fake.reset(metrics_prefix=prefix)
    cfg = _cfg(fake, max_concurrency=(1, 2))
    result = run(cfg, [Prompt("ttft=0.01 n=2", 8)] * 3, progress=False)
    for p in result["points"]:
        # 3 requests x (4 verify steps, 12 drafts, 6 accepted); the warm-up is before both.
        assert p["spec_decode"] == {
            "num_drafts": 3 * DRAFTS,
            "num_draft_tokens": 3 * DRAFT_TOKENS,
            "num_accepted_tokens": 3 * ACCEPTED,
            "accept_length": 1 + ACCEPTED / DRAFTS,
            "acceptance_rate": ACCEPTED / DRAFT_TOKENS,
        }
        assert p["accept_length"] == 2.5


def test_servers_without_speculative_metrics_report_null(fake):
    fake.reset(metrics_prefix=None)
    p = _point(fake, ["ttft=0.01 n=2"] * 2)
    assert p["completed"] == 2 and p["accept_length"] is None and p["spec_decode"] is None


def test_prometheus_text_is_summed_over_label_sets():
    text = (
        "# HELP outrider:spec_decode_num_drafts_total Verify steps.\n"
        "# TYPE outrider:spec_decode_num_drafts_total counter\n"
        'outrider:spec_decode_num_drafts_total{model_name="a b"} 10.0\n'
        'outrider:spec_decode_num_drafts_total{model_name="c"} 5.0 1700000000\n'
        "outrider:spec_decode_num_draft_tokens_total 40\n"
        "outrider:spec_decode_num_accepted_tokens_total 2.5e1\n"
        "outrider:kv_cache_usage_perc NaN\n"
    )
    samples = parse_prometheus(text)
    assert samples["outrider:spec_decode_num_drafts_total"] == 15.0
    assert math.isnan(samples["outrider:kv_cache_usage_perc"])
    before = spec_counters(text)
    assert before == {"num_drafts": 15.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 25.0}
    assert spec_counters("vllm:num_requests_running 1\n") is None
    assert spec_delta(before, before) is None  # nothing verified during the point
    after = {"num_drafts": 25.0, "num_draft_tokens": 80.0, "num_accepted_tokens": 45.0}
    assert spec_delta(before, after)["accept_length"] == 3.0
    assert spec_delta(None, after) is None


def test_tensor_parallel_counters_give_collectives_per_forward_over_a_point():
    def text(decode: int, calls: int) -> str:
        d = 'model_name="m",mode="decode"'
        return (
            'outrider:tensor_parallel_size{model_name="m"} 2.0\n'
            f'outrider:collective_calls_total{{{d},op="all_reduce"}} {calls}\n'
            f'outrider:collective_calls_total{{{d},op="all_gather"}} {decode}\n'
            f'outrider:collective_bytes_total{{{d},op="all_reduce"}} {calls * 64}\n'
            'outrider:collective_calls_total{model_name="m",mode="other",op="broadcast"} 7.0\n'
            f"outrider:forwards_total{{{d}}} {decode}\n"
        )  # fmt: skip

    before, after = tp_counters(text(2, 18)), tp_counters(text(6, 54))
    assert before[("collective_calls", "decode", "all_reduce")] == 18.0
    assert before[("forwards", "decode", "")] == 2.0
    assert tp_delta(before, after) == {
        "decode": {
            "forwards": 4, "all_reduce_per_forward": 9.0, "all_gather_per_forward": 1.0,
            "broadcast_per_forward": 0.0, "bytes_per_forward": 9.0 * 64,
        }
    }  # fmt: skip
    assert tp_delta(after, after) is None  # no forward ran during the point
    one_rank = 'outrider:tensor_parallel_size{model_name="m"} 1.0\n'
    assert tp_counters(one_rank) == {} and tp_delta({}, tp_counters(one_rank)) is None


# -- the arithmetic, exactly ---------------------------------------------------------------------


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    for n in (1, 2, 7, 100):
        values = sorted(rng.uniform(0, 50) for _ in range(n))
        for p in (0, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_summary_tpot_and_goodput_follow_vllm_definitions():
    results = [
        # TPOT (1.0 - 0.1) / 9 = 100 ms
        RequestResult(ok=True, latency=1.0, ttft=0.1, output_tokens=10, prompt_tokens=5),
        # TPOT 20 ms, TTFT 300 ms
        RequestResult(ok=True, latency=0.5, ttft=0.3, output_tokens=11, prompt_tokens=5),
        # One token: no TPOT, counts 0 against a TPOT SLO
        RequestResult(ok=True, latency=0.05, ttft=0.05, output_tokens=1, prompt_tokens=5),
        RequestResult(ok=False, error="HTTP 503: busy"),
    ]
    cfg = BenchConfig(base_url="http://x", slo_ttft_ms=200, slo_tpot_ms=50)
    s = summarize(results, duration=2.0, cfg=cfg)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["mean_tpot_ms"] == pytest.approx(60.0)  # mean of 100 and 20 only
    assert s["good_completed"] == 1  # the first misses TPOT, the second TTFT
    assert s["request_goodput"] == 0.5
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (15, 22)
    assert s["total_token_throughput"] == 18.5 and s["output_throughput"] == 11.0
    assert s["errors"] == {"HTTP 503: busy": 1}
    empty = summarize([RequestResult(ok=False, error="x")], 1.0, cfg)
    assert empty["mean_ttft_ms"] is None and empty["p99_e2el_ms"] is None


def test_poisson_arrivals_have_the_requested_rate():
    times = arrival_times(4000, 50.0, random.Random(0))
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / 3999 == pytest.approx(1 / 50, rel=0.05)
    assert arrival_times(5, math.inf, random.Random(0)) == [0.0] * 5


# -- datasets ----------------------------------------------------------------------------------


def test_sharegpt_json_list_takes_the_first_human_turn(tmp_path):
    path = tmp_path / "sharegpt.json"
    records = [
        {"id": "1", "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "  first question  "},
            {"from": "gpt", "value": "an answer"},
            {"from": "human", "value": "second question"},
        ]},
        {"id": "2", "conversations": [{"from": "gpt", "value": "no user turn"}]},
        {"id": "3", "conversations": []},
    ]  # fmt: skip
    path.write_text(json.dumps(records))
    assert file_prompts(path) == ["first question"]


def test_jsonl_and_single_records_with_roles_and_content_parts(tmp_path):
    jsonl = tmp_path / "chats.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "q1"}]},
        {"conversations": [{"role": "user", "content": [{"type": "text", "text": "q2"}]}]},
        {"messages": [{"role": "assistant", "content": "only an answer"}]},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    assert file_prompts(jsonl) == ["q1", "q2"]
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"messages": [{"role": "user", "content": "q3"}]}, indent=2))
    assert file_prompts(one) == ["q3"]


def test_bad_dataset_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file '.*missing.json'.*JSONL"):
        file_prompts(tmp_path / "missing.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2 is not valid JSON"):
        file_prompts(bad)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([{"messages": [{"role": "assistant", "content": "no turns"}]}]))
    with pytest.raises(ValueError, match="none of its 1 records has a user turn"):
        file_prompts(empty)


def test_load_prompts_builtin_grounded_sharegpt_and_random(tmp_path):
    from outrider.bench.datasets import GROUNDED, HELDOUT, HELDOUT_FRESH

    base = {"base_url": "http://x", "num_prompts": 12, "max_tokens": 32, "seed": 3}
    builtin = load_prompts(BenchConfig(**base))
    assert len({p.text for p in builtin}) == 12  # fewer than the set: no repeats
    assert {p.text for p in builtin} <= set(GROUNDED + HELDOUT + HELDOUT_FRESH)
    assert {p.max_tokens for p in builtin} == {32}
    assert load_prompts(BenchConfig(**base)) == builtin  # seeded
    assert load_prompts(BenchConfig(**{**base, "seed": 4})) != builtin
    grounded = load_prompts(BenchConfig(**base, dataset="grounded"))
    assert {p.text for p in grounded} <= set(GROUNDED)  # the text-reusing tasks only
    assert len({p.text for p in grounded}) == min(12, len(GROUNDED))

    path = tmp_path / "two.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "a"}]}\n'
                    '{"messages": [{"role": "user", "content": "b"}]}\n')  # fmt: skip
    cycled = load_prompts(BenchConfig(**base, dataset="sharegpt", dataset_path=str(path)))
    assert sorted(p.text for p in cycled) == ["a"] * 6 + ["b"] * 6

    rand = load_prompts(
        BenchConfig(**base, dataset="random", random_input_len=50, random_output_len=7)
    )
    assert len(rand) == 12 and len({p.text for p in rand}) == 12
    assert all(len(p.text.split()) == 50 and p.max_tokens == 7 for p in rand)


# -- the command line --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--max-concurrency", "1", "0"],
            "--max-concurrency 1 0: every value must be a positive integer",
        ),
        (["--base-url", "localhost:8000"], "'localhost:8000' is not an http(s) URL"),
        (["--dataset", "sharegpt", "/nonexistent/sg.json"], "no file '/nonexistent/sg.json'"),
        (["--dataset", "sharegpt"], "--dataset sharegpt takes a file"),
        (
            ["--dataset", "bogus"],
            "--dataset 'bogus': use builtin, grounded, sharegpt PATH or random",
        ),
        (["--request-rate", "0"], "--request-rate 0.0 must be positive"),
        (["--client-processes", "0"], "--client-processes 0 must be positive"),
    ],
)
def test_bad_flags_are_clear_errors(argv, says, capsys):
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert says in err.replace("\n", " "), err


def test_an_unreachable_server_is_a_clear_error(capsys, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--out-dir", str(tmp_path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"could not reach http://127.0.0.1:{port}/v1/models" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_failing_endpoint_stops_at_the_warm_up(fake):
    with pytest.raises(BenchError, match=r"warm-up request .* failed \(HTTP 500: injected"):
        run(_cfg(fake), [Prompt("fail", 8)], progress=False)


def test_cli_writes_json_and_pngs_and_sends_the_api_key(fake, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(
        json.dumps({"conversations": [{"from": "human", "value": f"ttft=0.01 n=4 q{i}"}]}) + "\n"
        for i in range(3)
    ))  # fmt: skip
    out = tmp_path / "out"
    argv = ["bench", "serve", "--base-url", fake.url, "--api-key", "sk-test",
            "--dataset", "sharegpt", str(data), "--max-concurrency", "1", "2",
            "--num-prompts", "4", "--out-dir", str(out), "--label", "fake run", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert fake.state()["auth"] == ["Bearer sk-test"]  # every route, /metrics included
    (path,) = out.glob("*.json")
    result = json.loads(path.read_text())
    assert (result["model"], result["label"]) == ("fake-model", "fake run")
    assert result["config"]["request_rate"] == "inf" and "api_key" not in result["config"]
    assert {"command", "date", "commit", "machine", "versions"} <= result.keys()
    assert [(p["max_concurrency"], p["completed"]) for p in result["points"]] == [(1, 4), (2, 4)]
    pngs = sorted(x.name.removeprefix(path.stem + "-") for x in out.glob("*.png"))
    assert pngs == ["accept_length.png", "per_user.png", "throughput.png", "tpot.png", "ttft.png"]
    stdout = capsys.readouterr().out
    assert str(path) in stdout and stdout.count(".png") == 5


def test_point_summaries_start_on_their_own_line_under_a_progress_bar_off_a_terminal(fake, capsys):
    def say(p: dict) -> None:
        print(f"[bench] concurrency {p['max_concurrency']}: done", file=sys.stderr)

    run(_cfg(fake, max_concurrency=(1, 2)), [Prompt("ttft=0.01 n=2", 8)] * 2, on_point=say)
    err = capsys.readouterr().err
    summaries = [line for line in err.split("\n") if "[bench]" in line]
    assert summaries == ["[bench] concurrency 1: done", "[bench] concurrency 2: done"], err


def test_vllm_save_result_flags_name_the_result_file(fake, tmp_path):
    from outrider.cli import build_parser

    argv = ["bench", "serve", "--base-url", fake.url, "--save-result", "--result-dir",
            str(tmp_path / "r"), "--result-filename", "mine.json"]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert (args.out_dir, args.result_filename, args.save_result) == (
        str(tmp_path / "r"), "mine.json", True
    )  # fmt: skip
    argv += ["--num-prompts", "2", "--max-concurrency", "1", "--no-plot", "--no-progress"]
    assert main(argv) == 0
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["mine.json"]


# -- plots -------------------------------------------------------------------------------------


def _result(label: str, accept: float | None) -> dict:
    spec = None if accept is None else {"num_drafts": 40, "num_accepted_tokens": 56}
    points = [
        {"max_concurrency": c, "output_throughput": 20.0 * c**0.8, "median_tpot_ms": 40 + c,
         "p90_tpot_ms": 45 + c, "median_ttft_ms": 90 + c, "p90_ttft_ms": 99 + c,
         "accept_length": accept, "spec_decode": spec, "total_output_tokens": 128}
        for c in (1, 2, 4, 8)
    ]  # fmt: skip
    return {"label": label, "points": points}


def test_every_chart_of_a_set_gives_a_run_one_colour_and_axes_from_their_floor(
    tmp_path, monkeypatch, capsys
):
    from matplotlib.figure import Figure

    from outrider.bench.plot import load_results, plot_results

    saved: dict[str, Figure] = {}
    real = Figure.savefig

    def savefig(fig, path, **kw):
        saved[Path(path).stem] = fig
        real(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    # Plain first: it takes C0, so a chart that started its own cycle at the first run it
    # draws would give eagle3 plain's colour there.
    both = tmp_path / "both.json"
    runs = {"plain": _result("x", None), "eagle3": _result("y", 2.4)}
    both.write_text(json.dumps({"runs": runs}))
    lines = []
    plot_results(load_results([both]), tmp_path, say=lines.append)
    assert sorted(saved) == ["accept_length", "per_user", "throughput", "tpot", "ttft"]
    colours: dict[str, set] = {}
    for fig in saved.values():
        for line in fig.axes[0].get_lines():
            if line.get_xdata().size and not line.get_label().startswith("_"):  # p90: no label
                colours.setdefault(line.get_label().split(" ")[0], set()).add(line.get_color())
    assert colours == {"plain": {"C0"}, "eagle3": {"C1"}}
    # Axes start at their floor, not at a sliver around the data.
    for name in ("throughput", "tpot", "ttft", "per_user"):
        assert saved[name].axes[0].get_ylim()[0] == 0, name
    accept = saved["accept_length"].axes[0]
    assert accept.get_ylim()[0] == 1 and accept.get_ylim()[1] > 2.4
    # The run without speculation is named, and each point says what it averages.
    legend = [t.get_text() for t in accept.get_legend().get_texts()]
    assert "plain: no speculation (no accept length)" in legend
    notes = {t.get_text() for t in accept.texts}
    assert notes == {"n=40, 75% of tokens"}  # (40 + 56) / 128 tokens from verify steps
    assert "[plot] plain at concurrency 1: accept length none (no speculative" in lines[0]
    assert (
        "[plot] eagle3 at concurrency 8: accept length 2.40 over 40 verify steps, 75% of "
        "output tokens from verify steps" in lines
    )


def test_accept_summary_prefers_outrider_step_counters():
    text = (
        'outrider:spec_decode_num_drafts_total{model_name="m"} 10\n'
        'outrider:spec_decode_num_draft_tokens_total{model_name="m"} 30\n'
        'outrider:spec_decode_num_accepted_tokens_total{model_name="m"} 20\n'
        'outrider:spec_decode_steps_total{model_name="m",k="0"} 3\n'
        'outrider:spec_decode_steps_total{model_name="m",k="3"} 7\n'
        'outrider:steps_run_ahead_total{model_name="m"} 4\n'
    )
    before = spec_counters(text)
    assert (before["plain_steps"], before["spec_steps"]) == (3.0, 7.0)
    assert before["steps_run_ahead"] == 4.0
    after = before | {"num_drafts": 12, "num_accepted_tokens": 26}
    after |= {"spec_steps": 9, "plain_steps": 9, "steps_run_ahead": 10}
    d = spec_delta(before, after)
    assert d["accept_length"] == 4.0 and d["spec_step_share"] == 0.25 and d["decode_steps"] == 8
    assert d["run_ahead_share"] == 0.75  # 6 of the 8 decode steps were launched ahead
    point = {"accept_length": 4.0, "spec_decode": d, "total_output_tokens": 100}
    assert accept_summary(point) == "4.00 over 2 verify steps, 25% of decode steps speculative"


def test_accept_length_chart_marks_the_points_that_verified_nothing(tmp_path, monkeypatch):
    """A run speculating at some concurrencies only: the others are drawn as x on the floor, so
    the axis spans them as the other charts do, and the legend says what x means."""
    from matplotlib.figure import Figure

    from outrider.bench.plot import load_results, plot_results

    saved: dict[str, Figure] = {}
    real = Figure.savefig

    def savefig(fig, path, **kw):
        saved[Path(path).stem] = fig
        real(fig, path, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    run = _result("eagle3", 2.4)
    run["points"][0] |= {"accept_length": None, "spec_decode": None}  # C=1 verified nothing
    path = tmp_path / "eagle3.json"
    path.write_text(json.dumps(run))
    plot_results(load_results([path]), tmp_path)
    ax = saved["accept_length"].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["eagle3 (1 point without: x at 1)"]
    crosses = [ln for ln in ax.get_lines() if ln.get_marker() == "x"]
    assert [list(ln.get_xdata()) for ln in crosses] == [[1]]
    assert list(crosses[0].get_ydata()) == [1] and crosses[0].get_color() == "C0"
    assert ax.get_xlim()[0] < 1


def test_a_point_where_the_controller_never_speculated_says_so():
    """An adaptive server that chose plain steps throughout a point is not a server without
    speculation: the summary counts the decode steps, and the accept length stays null."""
    text = (
        'outrider:spec_decode_num_drafts_total{model_name="m"} 10\n'
        'outrider:spec_decode_num_draft_tokens_total{model_name="m"} 30\n'
        'outrider:spec_decode_num_accepted_tokens_total{model_name="m"} 20\n'
        'outrider:spec_decode_steps_total{model_name="m",k="0"} 3\n'
        'outrider:spec_decode_steps_total{model_name="m",k="3"} 7\n'
    )
    before = spec_counters(text)
    d = spec_delta(before, before | {"plain_steps": 43})
    assert (d["accept_length"], d["spec_step_share"], d["decode_steps"]) == (None, 0.0, 40)
    point = {"accept_length": None, "spec_decode": d, "total_output_tokens": 40}
    want = "none: 0 of 40 decode steps speculated (the server chose plain decoding)"
    assert accept_summary(point) == want
    assert spec_delta(before, before) is None  # no step at all: nothing to say


def test_plot_overlays_results_into_pngs_of_the_expected_size(tmp_path, capsys):
    from matplotlib.image import imread

    from outrider.bench.plot import load_results

    spec, plain = tmp_path / "spec.json", tmp_path / "plain.json"
    spec.write_text(json.dumps(_result("spec", 2.4)))
    plain.write_text(json.dumps(_result("plain", None)))
    vllm = []
    for c in (2, 1):  # vllm bench serve --save-result: one flat point per file
        v = tmp_path / f"vllm-c{c}.json"
        v.write_text(json.dumps({"label": "vllm", "max_concurrency": c, "median_tpot_ms": 30,
                                 "output_throughput": 25.0 * c}))  # fmt: skip
        vllm.append(v)
    series = load_results([spec, plain, *vllm])
    assert [(label, [p["max_concurrency"] for p in pts]) for label, pts in series] == [
        ("spec", [1, 2, 4, 8]),
        ("plain", [1, 2, 4, 8]),
        ("vllm", [1, 2]),
    ]
    out = tmp_path / "plots"
    assert (
        main(["bench", "plot", str(spec), str(plain), *map(str, vllm), "--out-dir", str(out)]) == 0
    )
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        f"compare-{n}.png" for n in ("accept_length", "per_user", "throughput", "tpot", "ttft")
    ]
    for png in out.iterdir():
        image = imread(png)
        assert image.shape == (450, 700, 4), png
        assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    # Without any accept length there is no accept-length chart; one file is named after itself.
    assert main(["bench", "plot", str(plain)]) == 0
    assert sorted(p.name for p in tmp_path.glob("plain-*.png")) == [
        "plain-per_user.png", "plain-throughput.png", "plain-tpot.png", "plain-ttft.png"
    ]  # fmt: skip
    assert capsys.readouterr().out.count("wrote") == 9


def test_plot_refuses_files_that_are_not_results(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    assert main(["bench", "plot", str(other)]) == 2
    assert "is not a benchmark result" in capsys.readouterr().err
    assert main(["bench", "plot", str(tmp_path / "nope.json")]) == 2
    assert "no result file" in capsys.readouterr().err


def test_engine_step_ledger_over_a_point_gives_each_kinds_share():
    from outrider.bench.stats import ledger_counters, ledger_delta

    def text(decode, verify):
        return "".join(
            f'outrider:engine_step_{series}_total{{kind="{kind}",model_name="m"}} {v}\n'
            for kind, values in (("decode_ahead", decode), ("verify", verify))
            for series, v in zip(("count", "seconds", "tokens", "rows"), values)
        )

    before = ledger_counters(text((10, 0.1, 40, 40), (5, 0.1, 30, 20)))
    after = ledger_counters(text((30, 0.3, 120, 120), (5, 0.1, 30, 20)))
    d = ledger_delta(before, after, duration=0.4)
    assert d["kinds"] == {
        "decode_ahead": {"steps": 20, "ms_per_step": 10.0, "tokens_per_step": 4.0,
                         "rows_per_step": 4.0, "time_share": 0.5},
    }  # fmt: skip
    assert d["busy_share"] == 0.5  # verify ran no step in the point: left out
    assert ledger_delta({}, ledger_counters("vllm:num_requests_running 1\n"), 1.0) is None
