"""The pure parts of benchmarks/spec_gpu.py: batching, output identity, summary tables.

No model runs here; the benchmark itself is smoke-run by hand (its docstring says how)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("spec_gpu.py")


def test_batches_are_full_and_cycle_the_prompts(bench):
    assert bench.batches([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert bench.batches([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4, 0]]
    # C larger than the set: one batch of C requests, every prompt counted again.
    assert bench.batches(["a", "b"], 5) == [["a", "b", "a", "b", "a"]]
    assert [len(b) for b in bench.batches(list(range(16)), 64)] == [64]
    assert bench.batches([7], 1) == [[7]]
    # At least min_batches: a set that fills one batch of C is served twice, cycled.
    assert bench.batches([0, 1, 2], 2, min_batches=3) == [[0, 1], [2, 0], [1, 2]]
    assert bench.batches(list(range(10)), 4, min_batches=2) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 0, 1],
    ]


def test_first_divergence(bench):
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert bench.first_divergence([5], [6]) == 0
    assert bench.first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert bench.first_divergence([], []) is None


def test_identity_summary(bench):
    plain = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]]
    same = bench.identity_summary(plain, plain)
    assert same == {"same_output_fraction": 1.0, "median_first_divergence": None}
    spec = [[1, 2, 3, 4], [1, 2, 0, 0], [5, 0, 7, 8], [5, 6, 7, 8]]
    out = bench.identity_summary(spec, plain)
    assert out["same_output_fraction"] == 0.5
    assert out["median_first_divergence"] == 1.5  # median of positions 2 and 1
    with pytest.raises(ValueError, match="3 outputs against 4"):
        bench.identity_summary(spec[:3], plain)


def test_summary_tables_from_runs(bench):
    def row(tok, speedup):
        return {"tok_per_s": tok, "speedup": speedup}

    runs = {
        "heldout_c1": {"plain": row(100.0, 1.0), "ngram": row(90.0, 0.9)},
        "heldout_c64": {"plain": row(2000.0, 1.0), "ngram": row(2200.0, 1.1),
                        "eagle3_tree": row(1000.0, 0.5)},
        "grounded_c1": {"plain": row(100.0, 1.0), "ngram": row(250.0, 2.5)},
    }  # fmt: skip
    out = bench.summary_tables(runs)
    assert out["speedup"] == {"ngram": {"1": 0.9, "64": 1.1}, "eagle3_tree": {"64": 0.5}}
    assert out["speedup_grounded"] == {"ngram": {"1": 2.5}}
    assert out["plain_tok_per_s"] == {
        "heldout": {"1": 100.0, "64": 2000.0},
        "grounded": {"1": 100.0},
    }
    assert json.loads(json.dumps(out)) == out  # keys survive the JSON round trip unchanged


def test_step_split_averages_the_timed_part(bench):
    before = {"steps": 10, "step_s": 1.0, "runner_s": 0.6, "by_k": {0: 4, 4: 6}}
    after = {"steps": 30, "step_s": 1.2, "runner_s": 0.75, "by_k": {0: 4, 3: 5, 4: 21}}
    assert bench.step_split(before, after) == {
        "runner_ms": 7.5,  # 0.15 s over 20 steps
        "host_ms": 2.5,  # (0.2 - 0.15) s over 20 steps
        "steps": 20,
        "steps_by_k": {"3": 5, "4": 15},
    }
    assert bench.step_split(after, after) is None


def test_the_clock_counts_steps_and_runner_time(bench):
    class Runner:
        def run(self, batch):
            time.sleep(0.002)

        run_spec = launch = run

    class Engine:
        def __init__(self):
            self.runner = Runner()
            self.speculator = SimpleNamespace(steps_by_k={0: 1})

        def step(self):
            self.runner.run(None)
            self.speculator.steps_by_k[0] += 1

    engine = Engine()
    before = bench._clock(engine)
    engine.step()
    engine.step()
    after = bench._clock(engine)
    split = bench.step_split(before, after)
    assert split["steps"] == 2 and split["steps_by_k"] == {"0": 2}
    assert split["runner_ms"] >= 2.0 and split["host_ms"] >= 0.0
    assert bench._clock(engine)["steps"] == 2  # wrapped once, not again


def test_configs_name_every_method(bench):
    specs = bench.spec_configs(k=5, draft=None)
    assert specs["plain"] is None and set(bench.CONFIGS) <= set(specs)
    assert specs["ngram"]["num_draft_tokens"] == 5
    assert specs["eagle3_tree"]["topk"] == 3 and specs["eagle3_tree"]["num_draft_tokens"] == 8
    assert {specs[n]["controller"] for n in ("adaptive_ngram", "adaptive_eagle3")} == {"adaptive"}
    tree = bench.spec_configs(k=5, draft=None, tree=(24, 4, 6))["eagle3_tree"]
    assert (tree["num_draft_tokens"], tree["topk"], tree["num_steps"]) == (24, 4, 6)


def test_summarize_takes_the_median_round_against_the_plain_runs_around_it(bench):
    # Plain drifts 1000 -> 800 -> 1200 tok/s over the slot (1000 tokens each time); the config
    # runs 1100, 880, 2000 tok/s on 990 tokens (its bf16 outputs end elsewhere).
    def plain(tps):
        return {"tok_per_s": tps, "seconds": 1000 / tps, "tokens": 1000}

    def run(tps, around, ids, acc):
        return {"tok_per_s": tps, "seconds": 990 / tps, "tokens": 990, "ids": ids,
                "accept_length": acc, "plain_around": [plain(p) for p in around]}  # fmt: skip

    tries = [
        run(1100.0, (1000.0, 800.0), [[1]], 2.0),
        run(880.0, (800.0, 1200.0), [[2]], 2.5),
        run(2000.0, (1200.0, 1000.0), [[3]], 3.0),
    ]
    row = bench.summarize(tries)
    assert row["speedup_rounds"] == [round(1100 / 900, 3), 0.88, round(2000 / 1100, 3)]
    assert row["speedup"] == round(1100 / 900, 3)  # the median round, not the 1.82 outlier
    assert row["tok_per_s"] == 1100.0
    # Wall time of the same requests: round 1 took 0.9 s against plain's mean 1.125 s.
    times = sorted([1.125 / 0.9, (1.25 + 1000 / 1200) / 2 / 1.125, (1000 / 1200 + 1) / 2 / 0.495])
    assert row["speedup_time"] == round(times[1], 3)
    assert row["tokens_vs_plain"] == 0.99
    assert row["ids"] == [[1]] and row["accept_length"] == 3.0 and "plain_around" not in row
