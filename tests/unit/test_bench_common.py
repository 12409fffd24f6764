"""benchmarks/common.py: which commit a result names; where a profiled stretch left the device idle."""

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


def test_device_idle_counts_overlapping_kernels_once_and_splits_launch_from_host_gaps(common):
    # busy 0-10 and 5-12 (one stretch of 12), a 4 us launch gap, 16-20, a 30 us host gap, 50-60
    spans = [(0.0, 10.0), (5.0, 12.0), (16.0, 20.0), (50.0, 60.0)]
    idle = common.device_idle(spans, host_gap_us=20.0)
    assert idle["window_ms"] == 0.06 and idle["busy_ms"] == 0.026
    assert idle["launch_gaps_fraction"] == round(4 / 60, 4)
    assert idle["host_gaps_fraction"] == 0.5
    assert idle["idle_fraction"] == round(34 / 60, 4)
    per_step = common.idle_per_step(spans, steps=2)
    assert per_step == {"launch_gaps_ms_per_step": 0.002, "host_gaps_ms_per_step": 0.015}


def test_device_idle_of_a_stretch_without_kernels_says_so(common):
    with pytest.raises(ValueError, match="no GPU kernels"):
        common.device_idle([])
