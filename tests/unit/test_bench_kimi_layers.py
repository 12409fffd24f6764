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


def test_shared_expert_storage_holds_one_copy_and_computes_as_separate_copies(bench):
    """Layers built under shared_expert_storage hold the same routed-expert tensors (one
    allocation for the whole depth), and a decode over them equals the same checkpoint built
    with a copy per layer: the share changes where the bytes live, not what a step computes."""
    import torch

    hf = bench.hf_config(bench.SMOKE, 4, 1)

    def runner(shared: bool):
        checkpoint = bench.random_checkpoint(hf, "cpu", torch.float32, share_experts=True)
        if not shared:
            return bench.build_runner(checkpoint, "cpu", "float32", (0,), 1)
        with bench.shared_expert_storage():
            return bench.build_runner(checkpoint, "cpu", "float32", (0,), 1)

    one, apart = runner(True), runner(False)
    experts = [layer.mlp.experts for layer in one.model.model.layers[1:]]
    assert len(experts) == 3
    for name in ("gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed"):
        first = getattr(experts[0], name)
        assert all(getattr(e, name) is first for e in experts[1:]), name
        separate = [getattr(layer.mlp.experts, name) for layer in apart.model.model.layers[1:]]
        assert len({t.data_ptr() for t in separate}) == 3
        assert all(torch.equal(first, t) for t in separate)
    # Back outside: a model built now holds its own experts again.
    again = bench.build_runner(
        bench.random_checkpoint(hf, "cpu", torch.float32), "cpu", "float32", (0,), 1
    )
    ptrs = {layer.mlp.experts.down_proj_scale.data_ptr() for layer in again.model.model.layers[1:]}
    assert len(ptrs) == 3
    x = torch.tensor([3, 17, 101, 7])
    with torch.inference_mode():  # each MoE layer's MLP in turn, routing included
        h_one = one.model.model.embed_tokens(x)
        h_apart = apart.model.model.embed_tokens(x)
        for a, b in zip(one.model.model.layers[1:], apart.model.model.layers[1:], strict=True):
            h_one, h_apart = a.mlp(h_one), b.mlp(h_apart)
    assert h_one.abs().max() > 0
    assert torch.equal(h_one, h_apart)
