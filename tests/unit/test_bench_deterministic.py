"""The pure parts of benchmarks/deterministic.py (a CUDA-only benchmark): its argument parsing
and help run on any machine, its configs (chains and a tree), and its cost table divides the right
figures. The benchmark itself runs on a GPU (its docstring says how)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.benchmarks import BENCH, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("deterministic.py")


def test_help_runs_without_cuda():
    out = subprocess.run(
        [sys.executable, str(BENCH / "deterministic.py"), "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--llama8b" in out.stdout and "--concurrency" in out.stdout


def test_configs_cover_chains_and_a_tree(bench):
    specs = bench.engine_specs(4, None)
    assert specs["plain"] is None
    assert set(bench.CONFIGS) <= set(specs)
    assert specs["ngram"]["num_draft_tokens"] == specs["eagle3_chain"]["num_draft_tokens"] == 4
    assert specs["eagle3_chain"].get("topk", 1) == 1 and specs["eagle3_tree"]["topk"] > 1
    assert all(s["controller"] == "fixed" for s in specs.values() if s is not None)


def test_cost_table(bench):
    row = {
        "default": {"plain": {"tok_per_s": 100.0, "speedup": 1.0},
                    "ngram": {"tok_per_s": 150.0, "speedup": 1.5}},
        "deterministic": {"plain": {"tok_per_s": 90.0, "speedup": 1.0},
                          "ngram": {"tok_per_s": 126.0, "speedup": 1.4}},
    }  # fmt: skip
    table = bench.cost_table({"c1": row}, [1])
    assert table == {"1": {"plain_tok_per_s_ratio": 0.9, "ngram_speedup_ratio": 0.933}}
    assert bench.identical([[1, 2], [3]], [[1, 2], [4]]) == 1


def test_seeded_sampling_compares_each_config_with_its_modes_plain(bench, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it batches as spec_gpu.py does

    class Fake:  # a request's tokens: its seed, then a config's own mark where it differs
        def __init__(self, off_seeds=()):
            self.off_seeds, self.seen = set(off_seeds), []

        def chat(self, convs, params):
            self.seen += [p.seed for p in params]
            return [
                type("Out", (), {"token_ids": [p.seed, int(p.seed in self.off_seeds)]})()
                for p in params
            ]

    convs = [[{"role": "user", "content": str(i)}] for i in range(5)]
    llms = {("default", "plain"): Fake(), ("default", "ngram"): Fake(off_seeds={1, 3}),
            ("deterministic", "plain"): Fake(), ("deterministic", "ngram"): Fake()}  # fmt: skip
    out = bench.seeded_sampling(llms, convs, 4, 8)
    assert out == {"default": {"ngram": "3/5"}, "deterministic": {"ngram": "5/5"}}
    assert llms[("default", "ngram")].seen == [0, 1, 2, 3, 4, 0, 1, 2]  # batches of 4, cycled
