"""`outrider` as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "outrider", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_generate():
    r = _run("--help")
    assert r.returncode == 0
    assert "generate" in r.stdout
    g = _run("generate", "--help")
    assert g.returncode == 0 and "--max-tokens" in g.stdout and "--raw" in g.stdout


@pytest.mark.slow
def test_generate_answers_and_reports_speed():
    r = _run(
        "generate", "--max-tokens", "12", "--dtype", "float32", "What is the capital of France?"
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


@pytest.mark.slow
def test_generate_raw_and_bad_model():
    r = _run("generate", "--raw", "--max-tokens", "4", "The capital of France is")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    bad = _run("generate", "--model", "/nonexistent/model.gguf", "hi")
    assert bad.returncode == 2
    assert "/nonexistent/model.gguf" in bad.stderr and "Traceback" not in bad.stderr
