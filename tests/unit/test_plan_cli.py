"""`outrider plan`: its JSON, its chart, its errors, and that it never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from outrider.cli import main

KIMI = ["plan", "kimi-k2.5", "--tp", "8", "--gpu", "rtx-pro-6000", "--link", "pcie5-nop2p"]


def test_json_has_the_promised_keys(capsys):
    assert main([*KIMI, "--nccl-channels", "4", "--batch", "1", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("allreduces_per_forward", "comm_ms", "decode_ms", "verify_ms", "draft_ms",
                "break_even_accept_len", "best"):  # fmt: skip
        assert key in out, key
    assert out["allreduces_per_forward"] == 122
    assert set(out["best"]) == {"1", "16"}
    assert out["comm_ms"]["verify"] < out["verify_ms"]
    spec_over_plain = (out["verify_ms"] + out["draft_ms"]) / out["decode_ms"]
    assert abs(out["break_even_accept_len"] - spec_over_plain) < 1e-3
    # Sixteen sequences touch more experts than one.
    batches = out["batches"]
    assert batches["16"]["decode"]["experts_touched"] > batches["1"]["decode"]["experts_touched"]


def test_table_and_png(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "llama-3.1-8b", "--batch", "1", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "decode" in out and "break-even" in out and "best:" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_a_clear_error(capsys):
    assert main(["plan", "kimi-k3"]) == 2
    assert "unknown model 'kimi-k3'" in capsys.readouterr().err
    assert main(["plan", "smollm2-135m", "--tp", "2"]) == 2
    assert "use one of 1, 3, 9" in capsys.readouterr().err
    assert main(["plan", "llama-3.1-8b", "--gpu", "h300"]) == 2
    assert "unknown GPU 'h300'" in capsys.readouterr().err
    # --calibrate prints a profile, no plan: a chart asked of it is refused before it measures
    assert main(["plan", "--calibrate", "--png", "p.png", "--calibrate-out", "c.json"]) == 2
    assert "`outrider plan MODEL --gpu c.json --png ...` after it" in capsys.readouterr().err


def test_plan_imports_no_torch():
    code = """
import contextlib, io, json, sys
from outrider.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    main(["plan", "deepseek-v3", "--tp", "8", "--json"])
    try:
        main(["plan", "--help"])
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in ("torch", "numpy", "matplotlib") if m in sys.modules)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []


def test_no_model_plans_the_embedded_default(monkeypatch, capsys):
    monkeypatch.delenv("OUTRIDER_MODEL", raising=False)
    assert main(["plan", "--batch", "1"]) == 0
    first, weights = capsys.readouterr().out.splitlines()[:2]
    # One GPU: no link in the header, as nothing crosses one.
    assert first == "smollm2-135m on 1 x H200, context 2048, eagle3"
    assert weights == "weights bf16: 0.27 GB per GPU of 141 GB"


def test_a_cpu_plan_says_cpu_and_its_chart_marks_the_best_few(tmp_path, monkeypatch, capsys):
    import dataclasses

    from matplotlib.figure import Figure

    from outrider.plan.calibrate import cpu_profile

    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps(dataclasses.asdict(cpu_profile(16, 25.2762))))
    figures = []
    real = Figure.savefig

    def savefig(fig, *a, **kw):
        figures.append(fig)
        return real(fig, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    png = tmp_path / "plan.png"
    argv = ["plan", "smollm2-135m", "--gpu", str(profile), "--batch", "1", "--png", str(png)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "smollm2-135m on cpu (16 threads), context 2048, eagle3",
        "weights fp32: 0.54 GB of 25.3 GB memory",
    ]
    (fig,) = figures
    assert fig._suptitle.get_text() == "smollm2-135m on cpu (16 threads), context 2048, eagle3"
    (ax,) = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0].startswith("best ") and ax.get_title().startswith("batch 1: best ")
    assert len(legend) == 5 and legend[-1] == "6 slower options: see the table"
    # No line reaches the top third, where the legend sits.
    highest = max(max(line.get_ydata()) for line in ax.get_lines() if len(line.get_ydata()))
    assert ax.get_ylim() == (0, pytest.approx(1.5 * highest))
