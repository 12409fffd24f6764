"""benchmarks/common.py: which commit a result names."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _head() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=BENCH)
    return out.stdout.strip() or None


def test_a_commit_file_this_repository_knows_defers_to_git(common, tmp_path, monkeypatch):
    head = _head()
    if head is None:
        pytest.skip("not a git checkout")
    monkeypatch.setattr(common, "COMMIT_FILE", tmp_path / ".commit")
    (tmp_path / ".commit").write_text(head + "\n")
    meta = common.metadata()
    assert meta["commit"] == head and meta["dirty"] == meta["git_here"]["dirty"]


def test_a_commit_file_from_elsewhere_names_the_commit(common, tmp_path, monkeypatch):
    """The remote machines carry a copy whose .git never saw the commit the file names."""
    unknown = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setattr(common, "COMMIT_FILE", tmp_path / ".commit")
    (tmp_path / ".commit").write_text(unknown + "\n")
    meta = common.metadata()
    assert meta["commit"] == unknown and meta["dirty"] is False
    assert meta["git_here"]["head"] == _head()
    assert "dirty" not in meta["git_here"]  # the stale checkout's, which says nothing of the run
    monkeypatch.setattr(common, "COMMIT_FILE", tmp_path / "absent")
    assert common.metadata()["commit"] == _head()
