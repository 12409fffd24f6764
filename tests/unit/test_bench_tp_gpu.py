"""benchmarks/tp_gpu.py's smoke path: the CPU over gloo, 2 ranks (spawned by the engine, or by
torchrun), tiny shapes. TP=2 output equals TP=1's, plain, n-gram and EAGLE-3; the chain step is
timed with the drafter on rank 0 beside the drafter split; and the JSON carries what a GPU run's
does (command, commit, machine, versions, the number of ranks, per part its settings)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


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


def test_smoke_draft_part_times_the_drafter_on_rank0_beside_the_split_one(tmp_path):
    script = REPO / "benchmarks" / "tp_gpu.py"
    cmd = [sys.executable, str(script), "--smoke", "--parts", "draft", "--out-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUTRIDER_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    part = json.loads((tmp_path / "tp_gpu_smoke.json").read_text())["parts"]["draft"]
    assert part["settings"]["tp"] == 2 and part["settings"]["ks"] == [0, 1, 3]
    one, split = (part["by_setting"][name] for name in ("drafter on rank 0", "drafter split"))
    assert (one["draft_tensor_parallel_size"], one["sharded"]) == (1, False)
    assert (split["draft_tensor_parallel_size"], split["sharded"]) == (2, True)
    assert not one["cuda_graphs"] and not split["cuda_graphs"]
    points = [(p["batch"], p["k"]) for p in one["points"]]
    assert points == [(p["batch"], p["k"]) for p in split["points"]]
    assert points == [(b, k) for b in (1, 4) for k in (0, 1, 3)]
    rows = part["side_by_side"]
    assert [(r["batch"], r["k"]) for r in rows] == points
    assert all(r["rank0_ms"] > 0 and r["split_ms"] > 0 for r in rows)
    for p, q in zip(one["points"], split["points"]):
        if p["k"] == 0:
            continue
        # On rank 0 alone the drafter runs no collective; split, each draft forward gathers
        # its head's logits once and reduces 3 times (embedding, o_proj, down_proj), 4 over
        # the target's streams (fc): k forwards a step, the first of them over the streams.
        assert "draft" not in p["collectives"]
        draft = q["collectives"]["draft"]
        assert draft["all_gather"]["calls"] == 1.0
        assert draft["all_reduce"]["calls"] == round((4 + 3 * (p["k"] - 1)) / p["k"], 3)
    assert "drafter on rank 0 and split" in proc.stdout


def test_smoke_kimi_timings_count_its_all_reduces_and_break_even(tmp_path):
    """--model kimi-k2.5 --smoke: the tiny model of Kimi's family (MLA, INT4 experts, 3 layers,
    1 dense) timed at TP=1 and TP=2 over gloo; every forward's all-reduces are 2 x 3 + 1, as the
    planner counts them, and each verify point carries verify ms / decode ms as its break-even."""
    script = REPO / "benchmarks" / "tp_gpu.py"
    cmd = [sys.executable, str(script), "--smoke", "--model", "kimi-k2.5", "--parts", "timings"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUTRIDER_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--out-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    part = json.loads((tmp_path / "tp_gpu_kimi_smoke.json").read_text())["parts"]["timings"]
    assert (part["settings"]["shape"], part["settings"]["layers"]) == ("kimi_k2", 3)
    tp1, tp2 = part["by_setting"]["tp1"], part["by_setting"]["tp2"]
    assert "points" in tp1, tp1
    for p in tp2["points"]:
        mode = "verify" if p["k"] else "decode"
        calls = p["collectives"]["all_reduce"]["calls"]
        assert calls == 7 == p["planner_collectives"]["calls"]["all_reduce"], (mode, p)
    decode = {p["batch"]: p["measured_ms"] for p in tp2["points"] if p["k"] == 0}
    for p in (p for p in tp2["points"] if p["k"]):
        assert p["break_even_accept_len"] == round(p["measured_ms"] / decode[p["batch"]], 3)
    # The Llama-only parts are refused with the fix; a whole Kimi does not fit one GPU.
    bad = subprocess.run(
        [*cmd[:-1], "equality"], capture_output=True, text=True, env=env, timeout=120
    )
    assert bad.returncode != 0 and "--parts timings comm" in bad.stderr
    sys.path.insert(0, str(REPO / "benchmarks"))
    import tp_gpu

    whole = tp_gpu.Sizes(tp_gpu.hf_config(tp_gpu.KIMI, 61, 1), "cuda", "bfloat16", (1,), (0,), 1, 0)
    assert not tp_gpu.fits_one_gpu(whole)
    assert tp_gpu.fits_one_gpu(dataclasses.replace(whole, hf=tp_gpu.hf_config(tp_gpu.KIMI, 4, 1)))
