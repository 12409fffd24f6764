"""benchmarks/tp_gpu.py's smoke path: the CPU over gloo, 2 ranks spawned by the engine, tiny
shapes. TP=2 output equals TP=1's, plain, n-gram and EAGLE-3, and the JSON carries what a GPU
run's does (command, commit, machine, versions, the number of ranks, per part its settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_equality_and_comm_write_one_json(tmp_path):
    script = REPO / "benchmarks" / "tp_gpu.py"
    cmd = [sys.executable, str(script), "--smoke", "--parts", "equality", "comm"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUTRIDER_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--out-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "tp_gpu_smoke.json").read_text())
    for key in ("command", "commit", "machine", "versions"):
        assert key in result, key
    assert (result["gpus"], result["backend"], result["smoke"]) == (2, "gloo", True)
    eq = result["parts"]["equality"]
    assert eq["all_equal"], eq["cases"]
    assert eq["settings"]["tp"] == 2 and eq["settings"]["shape"]["num_key_value_heads"] == 4
    cases = {c["case"]: c for c in eq["cases"]}
    assert set(cases) == {
        "tp1 plain", "tp1 ngram", "tp2 ngram", "tp2 eagle3 (random drafter on rank 0)",
        "tp2 plain",
    }  # fmt: skip
    assert cases["tp2 ngram"]["verify_steps"] > 0
    # 4 layers: 2 x 4 + 1 all-reduces (the embedding's too) and the LM head's all-gather.
    assert cases["tp2 ngram"]["per_forward"]["verify"]["all_reduce"]["calls"] == 9
    assert cases["tp2 plain"]["per_forward"]["decode"]["all_gather"]["calls"] == 1
    comm = result["parts"]["comm"]
    assert comm["backend"] == "gloo" and comm["best"] == "default"
    assert comm["settings"]["world_size"] == 2
    assert "tp2 eagle3" in proc.stdout and "best: default" in proc.stdout
