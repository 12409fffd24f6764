"""benchmarks/plan_accuracy.py measures two models in turns in one process and compares each
model's fitted profile on both: the plumbing, on two tiny random models on the CPU."""

from __future__ import annotations

import math

import pytest

from tests.benchmarks import load_benchmark
from tests.tiny import tiny_hf_config


@pytest.mark.slow
def test_two_models_measured_in_turns_are_fitted_and_cross_predicted():
    bench = load_benchmark("plan_accuracy.py")
    shapes = {
        "small": (tiny_hf_config(num_hidden_layers=2), True, None),
        "large": (tiny_hf_config(hidden_size=256, num_attention_heads=8), False, None),
    }
    measured = bench.measure_interleaved(
        (1, 2), (0, 1), reps=1, shapes=shapes, device="cpu", dtype="float32"
    )
    assert set(measured) == {"small", "large"}
    for name, m in measured.items():
        assert m.model.name == name
        assert sorted((p.batch, p.k) for p in m.points) == [(1, 0), (1, 1), (2, 0), (2, 1)]
        assert all(p.measured_ms > 0 and p.device_ms is None for p in m.points)  # no CUDA
    assert measured["large"].model.hidden_size == 2 * measured["small"].model.hidden_size

    from outrider.plan.calibrate import cpu_profile

    models = {n: m.model for n, m in measured.items()}
    points = {n: m.points for n, m in measured.items()}
    result = bench.compare(models, points, cpu_profile(1, 8.0), graphs=False)
    assert len(result["rows"]) == 8
    for row in result["rows"]:
        assert math.isfinite(row["cross_error"]) and math.isfinite(row["self_error"])
    assert result["worst_cross_error"] == max(abs(r["cross_error"]) for r in result["rows"])
