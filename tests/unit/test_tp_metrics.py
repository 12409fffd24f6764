"""/metrics reports what tensor parallelism moves: a server over the tiny model split over two
ranks (gloo on the CPU) shows 2 x layers + 1 all-reduces and one all-gather per decode forward
and a tensor-parallel size of 2; over one rank the size reads 1 and no collective is counted."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outrider import LLM
from outrider.bench.stats import tp_counters, tp_delta
from outrider.server.config import ServerConfig
from outrider.server.server import ServerThread
from tests.tiny import tiny_hf_config
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (fixture)

BODY = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def scrape(server) -> dict[str, dict[tuple, float]]:
    """Sample name -> {label items other than model_name: value}, from a few requests' run
    (the raw text under "text")."""
    for _ in range(3):
        r = httpx.post(server.url + "/completions", json=BODY, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    text = httpx.get(server.base + "/metrics", timeout=30).text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples.setdefault(s.name, {})[labels] = s.value
    samples["text"] = text
    return samples


@pytest.mark.slow
def test_tp2_server_metrics_count_each_decode_forwards_collectives(tiny_dir):  # noqa: F811
    layers = tiny_hf_config()["num_hidden_layers"]
    hidden = tiny_hf_config()["hidden_size"]
    with (
        LLM(str(tiny_dir[0]), tensor_parallel_size=2, dtype="float32", device="cpu") as llm,
        ServerThread(ServerConfig(), llm.engine) as server,
    ):
        m = scrape(server)
    assert m["outrider:tensor_parallel_size"] == {(): 2.0}
    calls, nbytes = m["outrider:collective_calls_total"], m["outrider:collective_bytes_total"]
    forwards = m["outrider:forwards_total"]
    decode = forwards[(("mode", "decode"),)]
    assert decode >= 2 * (BODY["max_tokens"] - 1)  # one request after another
    assert calls[(("mode", "decode"), ("op", "all_reduce"))] == (2 * layers + 1) * decode
    assert calls[(("mode", "decode"), ("op", "all_gather"))] == decode
    # Each all-reduce sums float32 hidden states of the forward's rows.
    reduced = nbytes[(("mode", "decode"), ("op", "all_reduce"))]
    assert reduced > 0 and reduced % (hidden * 4) == 0
    prefill = forwards[(("mode", "prefill"),)]
    assert calls[(("mode", "prefill"), ("op", "all_reduce"))] == (2 * layers + 1) * prefill
    # Step headers and start-up checks count under "other", which runs no forward.
    assert calls[(("mode", "other"), ("op", "broadcast"))] > 0
    assert (("mode", "other"),) not in forwards
    assert {dict(k)["op"] for k in calls} <= {"all_reduce", "all_gather", "broadcast"}
    # What `bench serve` records per point reads the same series.
    measured = tp_delta({}, tp_counters(m["text"]))
    assert measured["decode"]["all_reduce_per_forward"] == 2 * layers + 1
    assert measured["decode"]["all_gather_per_forward"] == 1


def test_tp1_server_reports_size_1_and_no_collectives(tiny_dir):  # noqa: F811
    core = LLM(str(tiny_dir[0]), dtype="float32", device="cpu", num_blocks=64).engine
    with ServerThread(ServerConfig(), core) as server:
        m = scrape(server)
    assert m["outrider:tensor_parallel_size"] == {(): 1.0}
    assert m["outrider:generation_tokens_total"][()] == 3 * BODY["max_tokens"]
    for name in ("collective_calls_total", "collective_bytes_total", "forwards_total"):
        assert f"outrider:{name}" not in m, name
    assert tp_delta({}, tp_counters(m["text"])) is None
