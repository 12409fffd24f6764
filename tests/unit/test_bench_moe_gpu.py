"""benchmarks/moe_gpu.py end to end on a tiny model of the family on the CPU (--smoke), and its
byte count of a decode step."""

from __future__ import annotations

import json
import sys

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("moe_gpu.py")


@pytest.mark.slow
def test_smoke_run_writes_every_row(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["moe_gpu.py", "--smoke", "--out-dir", str(tmp_path)])
    assert bench.main() == 0
    result = json.loads((tmp_path / "moe_gpu_smoke.json").read_text())
    smoke = result["models"]["smoke"]
    assert set(smoke["decode"]) == {"1", "2"}
    assert all(row["tok_per_s"] > 0 for row in smoke["decode"].values())
    assert smoke["layers"] == 3 and not smoke["int4_experts"]
    assert "commit" in result  # the run's metadata
    plan = smoke["plan"]  # the planner fitted on a dense model, predicting this one
    assert plan["fitted_on"] == "dense"
    assert sorted((r["batch"], r["k"]) for r in plan["rows"]) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert {r["model"] for r in plan["rows"]} == {"smoke"}
    assert plan["worst_cross_error"] == max(abs(r["cross_error"]) for r in plan["rows"])
    assert plan["holds"] == (plan["worst_cross_error"] <= bench.PLAN_GOAL)
    ratio = plan["verify_over_plain"]["2"]["1"]
    row = {(r["batch"], r["k"]): r["measured_ms"] for r in plan["rows"]}
    assert ratio == pytest.approx(row[2, 1] / row[2, 0], abs=1e-3)
    # Speculation at each curve and C, k fixed and adaptive: lossless; with k fixed, the full
    # acceptance of curve 1.0 seen (the adaptive controller may keep a tiny CPU model plain).
    for controller in ("fixed", "adaptive"):
        spec = smoke["synthetic"][controller]
        assert spec["controller"] == controller and set(spec["curves"]) == {"1.0", "0.5"}
        for curve in spec["curves"].values():
            assert set(curve) == {"1", "2"} and all(r["lossless"] for r in curve.values())
    fixed = smoke["synthetic"]["fixed"]["curves"]["1.0"]
    assert all(r["accept_length"] > 2 for r in fixed.values()), fixed
    assert (tmp_path / "moe_gpu_smoke.png").is_file()


def test_expected_experts_follows_uniform_routing(bench):
    assert bench.expected_experts(64, 6, 1) == pytest.approx(6)
    assert bench.expected_experts(64, 6, 1000) == pytest.approx(64, rel=1e-6)
    # Two tokens overlap in top_k^2 / E experts on average.
    assert bench.expected_experts(64, 6, 2) == pytest.approx(12 - 36 / 64)


def test_unknown_model_is_refused_with_the_choices(bench):
    with pytest.raises(ValueError, match="moonlight-16b-a3b or kimi-k2.5"):
        bench.model_config("moonlight", 4)
