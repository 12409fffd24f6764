"""benchmarks/stop_strings.py: the detokenizer before the automaton (loaded from git) and the
one now give the same deltas on the benchmark's text, stop strings held back but never
completed, and stop strings that do complete."""

from __future__ import annotations

import subprocess

import pytest

from tests.benchmarks import BENCH, load_benchmark


@pytest.fixture(scope="module")
def bench():
    module = load_benchmark("stop_strings.py")
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{module.REFERENCE}^{{commit}}"], cwd=BENCH, capture_output=True
    )
    if known.returncode != 0:
        pytest.skip(f"this checkout lacks the reference commit {module.REFERENCE}")
    return module


def test_old_and_new_detokenizers_agree_on_the_benchmark_text(bench):
    reference = bench.load_reference(bench.REFERENCE)
    for count, length in [(1, 2), (16, 3), (64, 12)]:
        row = bench.run_case(count, length, steps=200, budget_s=10, reference=reference)
        assert row["old"]["steps"] == row["new"]["steps"] == 200  # run_case compared the deltas


def test_matches_cut_the_same_text_in_both(bench):
    from outrider.core import Request, SamplingParams
    from outrider.engine.detokenizer import IncrementalDetokenizer

    reference = bench.load_reference(bench.REFERENCE).IncrementalDetokenizer
    pieces = ["ab c", "d ef", "gh a", "bcd ", "efgh"]
    tokenizer = bench.PieceTokenizer(pieces)
    for stops in (["c d", "gh"], ["h a", "abcd", "d e"], ["efgh"], ["a"]):
        for include in (False, True):
            params = SamplingParams(stop=stops, include_stop_str_in_output=include)
            out = []
            for cls in (reference, IncrementalDetokenizer):
                detok = cls(tokenizer, Request([0], params))
                deltas = [detok.update([i]) for i in range(1, len(pieces))] + [detok.flush()]
                out.append((deltas, detok.text, detok.stop_str))
            assert out[0] == out[1], (stops, include)
