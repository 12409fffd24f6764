"""benchmarks/kimi_layers.py on its --smoke model: the random INT4 checkpoint loads, the three
models are timed and the per-layer rows carry measured and predicted times."""

from __future__ import annotations

import dataclasses

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kimi_layers.py")


def test_the_config_is_the_planners_kimi_row(bench):
    from outrider.plan.models import from_hf_dict

    whole = from_hf_dict(bench.hf_config(bench.KIMI, 61, 1))
    # head_dim is not an MLA model's (its heads are the nope/rope/v widths).
    ignore = {"name", "head_dim"}
    for f in dataclasses.fields(whole):
        if f.name not in ignore:
            assert getattr(whole, f.name) == getattr(bench.KIMI, f.name), f.name


def test_smoke_derives_per_layer_times(bench):
    import torch

    from outrider.plan import calibrate

    gpu = calibrate.cpu_profile(torch.get_num_threads(), 16.0)
    result = bench.measure_layers(bench.SMOKE, 3, (1, 4), (0, 3), 3, "cpu", "float32", gpu)
    assert [(r["batch"], r["k"]) for r in result["per_layer"]] == [(1, 0), (1, 3), (4, 0), (4, 3)]
    assert result["cuda_graphs"]["moe3"] == {"decode": False, "verify": False}
    assert result["planner_model"]["expert_weights"] == "int4"
    assert result["planner_model"]["num_layers"] == 3
    for rows in result["steps"].values():
        assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
    # Per layer: differences of whole steps. Measured ones on a shared CPU may come out <= 0
    # for so small a model (then no error is given); the planner's are positive.
    step = {
        (name, r["batch"], r["k"], what): r[f"{what}_ms"]
        for name, rows in result["steps"].items()
        for r in rows
        for what in ("measured", "predicted")
    }
    for row in result["per_layer"]:
        b, k = row["batch"], row["k"]
        for what in ("measured", "predicted"):
            one = step["dense1", b, k, what]
            moe = (step["moe3", b, k, what] - one) / 2
            dense = step["dense2", b, k, what] - one
            assert row[f"moe_layer_{what}_ms"] == pytest.approx(moe, abs=1e-3)
            assert row[f"dense_layer_{what}_ms"] == pytest.approx(dense, abs=1e-3)
        assert row["moe_layer_predicted_ms"] > 0 and row["dense_layer_predicted_ms"] > 0
        measured, error = row["moe_layer_measured_ms"], row["moe_layer_error"]
        assert (error is None) == (measured <= 0)
        if measured > 0.1:  # well above the 4-decimal rounding
            predicted = row["moe_layer_predicted_ms"]
            assert error == pytest.approx(predicted / measured - 1, rel=0.01, abs=1e-3)
    assert "MoE ms" in bench.table(result)
