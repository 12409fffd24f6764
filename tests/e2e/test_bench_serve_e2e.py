"""`outrider bench serve` against a real `outrider serve` (the default model on CPU, n-gram
speculation) in a subprocess: a two-point sweep completes every request, its latencies are real
numbers, the accept length comes from the server's /metrics, and the charts are drawn."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest

from outrider.cli import main


@pytest.fixture(scope="module")
def served():
    proc = subprocess.Popen(
        [sys.executable, "-m", "outrider", "serve", "--host", "127.0.0.1", "--port", "0",
         "--dtype", "float32", "--device", "cpu", "--spec", "ngram",
         "--spec-controller", "fixed", "--num-draft-tokens", "4"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving" not in line:
            assert time.monotonic() < deadline, "the server did not start within 120 s"
            line = proc.stderr.readline()
            assert line or proc.poll() is None, f"the server exited with {proc.returncode}"
        yield re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_bench_serve_sweeps_a_live_outrider_server(served, tmp_path, capsys):
    from matplotlib.image import imread

    argv = ["bench", "serve", "--base-url", served, "--max-concurrency", "1", "2",
            "--num-prompts", "4", "--max-tokens", "16", "--out-dir", str(tmp_path),
            "--label", "outrider ngram", "--no-progress"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert result["label"] == "outrider ngram" and result["model"]
    assert [p["max_concurrency"] for p in result["points"]] == [1, 2]
    for p in result["points"]:
        assert (p["completed"], p["failed"], p["incomplete"]) == (4, 0, 0), p["errors"]
        for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms"):
            assert math.isfinite(p[key]) and p[key] > 0, (key, p[key])
        assert p["median_e2el_ms"] > p["median_ttft_ms"]
        # The server's usage: at most 16 tokens each, and the prompts' real token counts.
        assert 4 <= p["total_output_tokens"] <= 64 and p["total_input_tokens"] > 4 * 5
        assert p["output_throughput"] == pytest.approx(p["total_output_tokens"] / p["duration"])
        # n-gram speculation ran: the point's own verify steps, from /metrics.
        assert p["spec_decode"]["num_drafts"] > 0
        assert 1.0 <= p["accept_length"] <= 5.0
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 5  # throughput, TPOT, TTFT, per-user and accept length
    for png in pngs:
        assert imread(png).shape == (450, 700, 4)
