"""`outrider bench comm` over gloo with two ranks on this machine: the sizes decode and verify
send, the figures it writes, the planner reading them as a link, and the systemd unit reading
its settings."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess

import pytest
import torch

from outrider.bench.comm import CommConfig, candidates_for, env_text, parse_candidate, step_shapes
from outrider.cli import main
from outrider.plan.costmodel import Setup, decode_cost, verify_cost
from outrider.plan.hardware import load_gpu, load_link
from outrider.plan.models import load_model
from outrider.server import deploy

HIDDEN, VOCAB, LAYERS = 4096, 128256, 32  # llama-3.1-8b
YAML = "server: {port: 8080}\nmodel: {dtype: float32}\n"
ME = pwd.getpwuid(os.getuid()).pw_name  # deploy refuses a --user that does not exist


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    argv = ["bench", "comm", "--world-size", "2", "--device", "cpu", "--model", "llama-3.1-8b",
            "--batch", "1", "2", "--k", "0", "3", "--warmup", "1", "--iters", "2", "--trials",
            "1", "--out-dir", str(out)]  # fmt: skip
    return main(argv), out


def test_sizes_are_hidden_and_vocab_times_tokens_times_dtype():
    cfg = CommConfig(batch_sizes=(1, 8), ks=(0, 3), dtype="bf16")
    shapes = step_shapes(HIDDEN, VOCAB, cfg)
    assert [(s.batch, s.k, s.tokens) for s in shapes] == [(1, 0, 1), (1, 3, 4), (8, 0, 8),
                                                          (8, 3, 32)]  # fmt: skip
    assert [s.all_reduce_bytes for s in shapes] == [HIDDEN * 2 * t for t in (1, 4, 8, 32)]
    assert shapes[3].all_gather_bytes == VOCAB * 32 * 2
    fp32 = step_shapes(HIDDEN, VOCAB, CommConfig(batch_sizes=(1,), ks=(0,), dtype="fp32"))
    assert fp32[0].all_reduce_bytes == HIDDEN * 4


def test_candidates_and_their_errors():
    assert candidates_for("cpu", CommConfig(candidates=("proto-LL",))) == [("default", {})]
    cuda = candidates_for("cuda", CommConfig(candidates=("proto-LL",),
                                             extra_candidates=("NCCL_ALGO=Ring",)))  # fmt: skip
    assert [n for n, _ in cuda] == ["default", "proto-LL", "NCCL_ALGO=Ring"]
    assert parse_candidate("NCCL_PROTO=LL, NCCL_MIN_NCHANNELS=8") == {
        "NCCL_PROTO": "LL", "NCCL_MIN_NCHANNELS": "8"}  # fmt: skip
    with pytest.raises(ValueError, match="not an NCCL_NAME=VALUE"):
        parse_candidate("PROTO=LL")
    with pytest.raises(ValueError, match="unknown candidate 'proto-XL'"):
        CommConfig(candidates=("proto-XL",))
    with pytest.raises(ValueError, match="needs 2 or more ranks"):
        CommConfig(world_size=1)


def test_env_text_holds_the_best_nccl_settings():
    row = {"bytes": 8192, "us": 10.0}
    result = {
        "backend": "nccl", "world_size": 8, "created": "now", "best": "proto-LL",
        "candidates": [
            {"name": "default", "settings": {}, "score_us": 900.0, "all_reduce": [row]},
            {"name": "proto-LL", "settings": {"NCCL_PROTO": "LL", "NCCL_MIN_NCHANNELS": "8"},
             "score_us": 600.0, "all_reduce": [row]},
        ],
    }  # fmt: skip
    lines = env_text(result).splitlines()
    assert [x for x in lines if not x.startswith("#")] == ["NCCL_PROTO=LL", "NCCL_MIN_NCHANNELS=8"]
    assert "0.600 ms" in env_text(result) and "0.900 ms" in env_text(result)


@pytest.mark.slow
def test_gloo_measures_every_size(measured, capsys):
    rc, out = measured
    assert rc == 0
    result = json.loads((out / "comm.json").read_text())
    assert result["backend"] == "gloo" and result["world_size"] == 2
    assert [c["name"] for c in result["candidates"]] == ["default"]  # gloo: no candidates
    best = result["candidates"][0]
    tokens = (1, 2, 4, 8)  # B(1+k) for B in 1, 2 and k in 0, 3
    assert [r["bytes"] for r in best["all_reduce"]] == [HIDDEN * 2 * t for t in tokens]
    assert [r["bytes"] for r in best["all_gather"]] == [VOCAB * 2 * t for t in tokens]
    for r in best["all_reduce"] + best["all_gather"]:
        assert r["us"] > 0 and r["busbw_gbs"] > 0
    # bus bandwidth at 2 ranks: an all-reduce moves its whole buffer, an all-gather half
    r = best["all_reduce"][0]
    assert r["busbw_gbs"] == pytest.approx(r["bytes"] / r["us"] / 1e3, rel=1e-2)


@pytest.mark.slow
def test_planner_reads_the_measured_link(measured):
    _, out = measured
    link = load_link(str(out / "link.json"))
    assert link.world_size == 2
    table = {k: dict(v) for k, v in link.measured.items()}
    setup = Setup(load_model("llama-3.1-8b"), load_gpu("h200"), link, tp=2)
    nvlink = Setup(load_model("llama-3.1-8b"), load_gpu("h200"), load_link("nvlink4"), tp=2)
    # Decode at one sequence sends exactly the measured sizes: 2 x 32 + 1 all-reduces of
    # 8 KB and the LM head's 256 KB gather; and rank 0's 48-byte broadcast of the step's
    # inputs (one token: ids, positions, slots, logits row, 4 int32 lengths and table
    # entries), priced as an all-gather with twice its bytes out at 2 ranks.
    want = (2 * LAYERS + 1) * table["all_reduce"][HIDDEN * 2] + table["all_gather"][VOCAB * 2]
    want += link.all_gather_us(2 * 48, 2)
    assert decode_cost(setup, 1, 0).comm_ms == pytest.approx(want / 1e3, rel=1e-6)
    assert decode_cost(setup, 1, 0).comm_ms != pytest.approx(decode_cost(nvlink, 1, 0).comm_ms)
    verify = verify_cost(setup, 2, 4, 0).comm_ms  # 8 tokens: the largest size measured
    want = (2 * LAYERS + 1) * table["all_reduce"][HIDDEN * 16] + table["all_gather"][VOCAB * 16]
    want += link.all_gather_us(2 * (32 * 8 + 4 * 5 + 4 * 2), 2)  # the inputs: 8 tokens, 2 rows
    assert verify == pytest.approx(want / 1e3, rel=1e-6)
    with pytest.raises(ValueError, match="measured at 2 ranks, not 4"):
        decode_cost(Setup(load_model("llama-3.1-8b"), load_gpu("h200"), link, tp=4), 1, 0)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The unit's private /tmp at tmp_path: the embedded model may lie under /tmp (a clone)."""
    monkeypatch.setattr(deploy, "PRIVATE_TMP", (tmp_path,))


@pytest.mark.slow
@pytest.mark.usefixtures("private_tmp")
def test_systemd_unit_includes_the_env_file(measured, tmp_path, capsys):
    _, out = measured
    env_file = out / "comm.env"
    assert "no candidates" not in env_file.read_text()
    assert "NCCL settings do not apply" in env_file.read_text()
    config = tmp_path / "server.yaml"
    config.write_text(YAML)
    bundle = tmp_path / "bundle"
    argv = ["deploy", "systemd", "--config", str(config), "--output", str(bundle), "--user", ME,
            "--env-file", str(env_file)]  # fmt: skip
    assert main(argv) == 0
    unit = (bundle / "outrider.service").read_text()
    lines = unit.splitlines()
    first = lines.index("EnvironmentFile=/etc/outrider/outrider.env")
    assert lines[first + 1] == "EnvironmentFile=/etc/outrider/comm.env"  # read after: it wins
    assert (bundle / "comm.env").read_text() == env_file.read_text()
    root = tmp_path / "root"
    stub = tmp_path / "systemctl"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    assert main([*argv, "--install", "--root", str(root), "--systemctl", str(stub)]) == 0
    assert (root / "etc/outrider/comm.env").read_text() == env_file.read_text()
    tool = shutil.which("systemd-analyze")
    if tool:  # systemd loads the unit as written
        proc = subprocess.run([tool, "verify", str(bundle / "outrider.service")],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "outrider.service:" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    # Without --env-file the unit reads outrider.env alone.
    assert main(argv[:-2] + ["--output", str(tmp_path / "plain")]) == 0
    assert "comm.env" not in (tmp_path / "plain" / "outrider.service").read_text()


@pytest.mark.usefixtures("private_tmp")
def test_env_file_errors_name_the_fix(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text(YAML)
    bad = tmp_path / "nccl.env"
    bad.write_text("# fine\nNCCL_PROTO=LL\nNCCL PROTO\n")
    argv = ["deploy", "systemd", "--config", str(config), "--output", str(tmp_path / "o"),
            "--user", ME]  # fmt: skip
    assert main([*argv, "--env-file", str(bad)]) == 2
    assert "nccl.env:3: 'NCCL PROTO' is not KEY=VALUE" in capsys.readouterr().err
    clash = tmp_path / "outrider.env"
    clash.write_text("A=1\n")
    assert main([*argv, "--env-file", str(clash)]) == 2
    assert "rename it" in capsys.readouterr().err
    assert main([*argv, "--env-file", str(tmp_path / "missing.env")]) == 2
    assert "bench comm" in capsys.readouterr().err
    assert main(["bench", "comm", "--world-size", "1"]) == 2
    assert "2 or more ranks" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "comm", "--device", "cuda"]) == 2
        assert "needs one GPU a rank, and this machine has 0" in capsys.readouterr().err
