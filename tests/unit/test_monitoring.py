"""docs/monitoring: the Grafana dashboard queries only series the server exports, and the
Prometheus example scrapes its /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from outrider.server.async_engine import EngineStats

DOCS = Path(__file__).resolve().parents[2] / "docs" / "monitoring"


def _exported() -> set[str]:
    from outrider.core import RequestOutput
    from outrider.server.metrics import ServerMetrics

    stats = EngineStats(
        num_running=1, num_waiting=0, num_free_blocks=5, num_blocks=10, num_preemptions=1,
        spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
        spec_accepted_per_position=(2, 2, 1, 0), spec_k=4, spec_steps_by_k=((0, 1), (4, 2)),
        steps_run_ahead=2,
        tp_size=2, collectives=(("decode", "all_reduce", 9, 900), ("decode", "all_gather", 1, 64)),
        forwards=(("decode", 1),),
    )  # fmt: skip
    m = ServerMetrics("m", lambda: stats)
    out = RequestOutput("r", None, [1], "a", [5, 6], True, "stop", {"num_prompt_tokens": 1})
    m.on_delta(out, None)
    m.on_delta(out, 0.1)
    m.on_finished(out)
    text = m.render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] not in "#"}


def test_every_dashboard_query_reads_an_exported_series():
    dash = json.loads((DOCS / "grafana-outrider.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"outrider:[a-z0-9_]+", e)}
    assert len(used) >= 10
    missing = used - _exported()
    assert not missing, f"the dashboard reads series the server does not export: {missing}"


def test_all_reduces_per_forward_panel_divides_by_forwards_per_mode():
    dash = json.loads((DOCS / "grafana-outrider.json").read_text())
    panel = next(p for p in dash["panels"] if "all-reduces per forward" in p["title"])
    expr = panel["targets"][0]["expr"].replace(" ", "")
    calls, forwards = expr.split("/")
    assert calls.startswith("sumby(mode)(rate(outrider:collective_calls_total{")
    assert 'op="all_reduce"' in calls
    assert forwards.startswith("sumby(mode)(rate(outrider:forwards_total{")
    assert "tensor_parallel_size" in panel["targets"][1]["expr"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_prometheus_example_scrapes_metrics():
    config = yaml.safe_load((DOCS / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"


def test_steps_run_ahead_are_exported_beside_the_decode_steps():
    exported = _exported()
    assert {"outrider:steps_run_ahead_total", "outrider:spec_decode_steps_total"} <= exported
