"""The pure parts of benchmarks/spec_gpu.py: batching, output identity, summary tables.

No model runs here; the benchmark itself is smoke-run by hand (its docstring says how)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_spec_gpu", BENCH / "spec_gpu.py")
    module = importlib.util.module_from_spec(spec)
    path_before = list(sys.path)
    try:
        spec.loader.exec_module(module)  # inserts benchmarks/ for `common`
    finally:
        sys.path[:] = path_before
    return module


def test_batches_are_full_and_cycle_the_prompts(bench):
    assert bench.batches([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert bench.batches([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4, 0]]
    # C larger than the set: one batch of C requests, every prompt counted again.
    assert bench.batches(["a", "b"], 5) == [["a", "b", "a", "b", "a"]]
    assert [len(b) for b in bench.batches(list(range(16)), 64)] == [64]
    assert bench.batches([7], 1) == [[7]]


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
    before = {"schedule": 1.0, "forward": 10.0}
    after = {"schedule": 1.5, "forward": 20.0}
    assert bench.step_split(before, after, 10) == {"schedule": 0.05, "forward": 1.0}
    counted = {"steps": 4, "forward": 2.0}
    assert bench.step_split({}, counted, 999) == {"forward": 0.5}  # the timer's own count wins
    assert bench.step_split(before, after, 0) is None


def test_configs_name_every_method(bench):
    specs = bench.spec_configs(k=5, draft=None)
    assert specs["plain"] is None and set(bench.CONFIGS) <= set(specs)
    assert specs["ngram"]["num_draft_tokens"] == 5
    assert specs["eagle3_tree"]["topk"] == 3 and specs["eagle3_tree"]["num_draft_tokens"] == 8
    assert {specs[n]["controller"] for n in ("adaptive_ngram", "adaptive_eagle3")} == {"adaptive"}
