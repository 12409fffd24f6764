"""Measured routing in the planner: `outrider bench routing` counts an MoE model's choices per
layer and expert as the engine runs it, and `outrider plan --routing` prices experts touched
and grouped-GEMM blocks from those counts (each expert's own binomial) instead of uniform
routing; uniform counts give the uniform figures back."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from outrider.cli import main
from outrider.plan.costmodel import (
    MOE_BLOCK_M,
    Setup,
    decode_cost,
    expert_blocks,
    routed_load,
    unique_experts,
)
from outrider.plan.hardware import load_gpu, load_link
from outrider.plan.models import load_model, read_routing


def simulate(probs: list[float], tokens: int, trials: int, rng: random.Random):
    """Experts touched and blocks of MOE_BLOCK_M rows, each token choosing each expert with its
    own probability (as routed_load takes choices), averaged over trials."""
    touched = blocks = 0.0
    for _ in range(trials):
        rows = [sum(rng.random() < p for _ in range(tokens)) for p in probs]
        touched += sum(r > 0 for r in rows)
        blocks += sum(-(-r // MOE_BLOCK_M) for r in rows)
    return touched / trials, blocks / trials


def test_uniform_counts_give_the_uniform_figures():
    kimi = load_model("kimi-k2.5")
    uniform = kimi.with_routing([[5] * kimi.num_experts])
    assert uniform.routing[0] == pytest.approx((8 / 384,) * 384)
    for tokens in (1, 4, 64, 512):
        ((touched, blocks),) = routed_load(uniform.routing, tokens)
        assert touched == pytest.approx(unique_experts(384, 8, tokens), rel=2e-3)
        assert blocks == pytest.approx(expert_blocks(384, 8, tokens), rel=2e-3)


def test_skewed_routing_touches_fewer_experts_and_runs_more_blocks():
    """64 experts top-6 (Moonlight's) with a few popular ones: the figures follow a simulation
    of the same probabilities, fewer experts than uniform, more blocks once rows pile up."""
    rng = random.Random(0)
    moon = dataclasses.replace(load_model("deepseek-v3"), experts_per_token=6, num_experts=64)
    counts = [int(1000 * rng.paretovariate(1.2)) for _ in range(moon.num_experts)]
    skewed = moon.with_routing([counts])
    for tokens in (4, 64, 512):
        ((touched, blocks),) = routed_load(skewed.routing, tokens)
        sim_touched, sim_blocks = simulate(list(skewed.routing[0]), tokens, 20_000 // tokens, rng)
        assert touched == pytest.approx(sim_touched, rel=0.03), tokens
        assert blocks == pytest.approx(sim_blocks, rel=0.03), tokens
        assert touched < unique_experts(64, 6, tokens)
    assert routed_load(skewed.routing, 512)[0][1] > expert_blocks(64, 6, 512)
    # The step prices what it reads: fewer experts touched at 64 tokens, a cheaper step.
    steps = [decode_cost(Setup(m, load_gpu("h200"), load_link("nvlink4")), 64, 1024)
             for m in (skewed, moon)]  # fmt: skip
    assert steps[0].experts_touched < steps[1].experts_touched and steps[0].ms < steps[1].ms


def test_per_layer_counts_price_each_layer():
    kimi = load_model("kimi-k2.5")
    flat, hot = [1] * 384, [1] * 384
    hot[:8] = [10_000] * 8  # nearly every token's 8 choices
    layers = [hot] + [flat] * (kimi.num_moe_layers - 1)
    loads = routed_load(kimi.with_routing(layers).routing, 64)
    assert loads[0][0] < 20 and loads[1][0] == pytest.approx(unique_experts(384, 8, 64), rel=2e-3)


@pytest.mark.parametrize(
    "counts, match",
    [
        ([[1] * 10], "must be 384 counts"),
        ([[0] * 384], "not all zero"),
        ([[1] * 384] * 3, "3 layers of counts, where kimi-k2.5 has 60 MoE layers"),
        ([[-1] + [1] * 383], "counts >= 0"),
    ],
)
def test_bad_counts_are_refused_naming_what_is_wrong(counts, match):
    with pytest.raises(ValueError, match=match):
        load_model("kimi-k2.5").with_routing(counts)


def test_a_dense_model_has_no_routing():
    with pytest.raises(ValueError, match="no routed experts"):
        load_model("llama-3.1-8b").with_routing([[1]])


def test_routing_files_are_read_or_refused_clearly(tmp_path):
    good = tmp_path / "r.json"
    good.write_text(json.dumps({"layers": [[1, 2], [3, 4]]}))
    assert read_routing(str(good)) == [[1, 2], [3, 4]]
    bad = tmp_path / "bad.json"
    for text, match in [("{", "not valid JSON"), ('{"counts": []}', 'with "layers"')]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_routing(str(bad))
    with pytest.raises(ValueError, match="cannot read it"):
        read_routing(str(tmp_path / "missing.json"))


@pytest.mark.slow
def test_bench_routing_counts_what_the_engine_routes_and_plan_prices_it(tmp_path, capsys):
    """A tiny DeepSeek-V3 (8 experts, 2 a token, 2 MoE layers) run over 3 prompts: every
    token's choices counted in each layer, and `outrider plan --routing` on the counts."""
    from tests.unit.test_deepseek_v3 import _hf_config, _hf_model, _save_tokenizer

    model = tmp_path / "tiny-ds"
    _hf_model(_hf_config(q_lora_rank=48)).save_pretrained(model, safe_serialization=True)
    _save_tokenizer(model)
    out = tmp_path / "routing.json"
    argv = ["bench", "routing", str(model), "--num-prompts", "3", "--max-tokens", "5"]
    assert main([*argv, "--device", "cpu", "--dtype", "float32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["experts_per_token"] == 2 and len(result["layers"]) == 2
    for row in result["layers"]:
        assert len(row) == 8 and sum(row) == 2 * result["tokens"]
    assert result["tokens"] > 3 * 4  # prompt tokens and the 4 generated tokens fed back
    assert "MoE layer 1" in capsys.readouterr().out
    plan = ["plan", str(model), "--batch", "8", "--json"]
    assert main(plan) == 0
    uniform = json.loads(capsys.readouterr().out)
    assert main([*plan, "--routing", str(out)]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured != uniform  # priced from the counts
    assert main(["plan", "llama-3.1-8b", "--routing", str(out)]) == 2  # refused, named
    assert "no routed experts" in capsys.readouterr().err
