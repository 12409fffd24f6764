"""serve() builds its engine apart: in a thread of its own that has ended when the server
starts, so that the engine thread is the only one whose torch ops ran on the CPU (engine_load.apart)."""

from __future__ import annotations

import threading

import pytest

from outrider.server.engine_load import apart


def test_apart_runs_off_the_callers_thread_returns_its_value_and_leaves_no_thread() -> None:
    seen: list[threading.Thread] = []

    def load(x: int, y: int) -> int:
        seen.append(threading.current_thread())
        return x * y

    assert apart(load, 6, 7) == 42
    assert len(seen) == 1
    assert seen[0] is not threading.current_thread()
    assert seen[0].name == "outrider-load"
    assert not seen[0].is_alive()


def test_apart_raises_the_loaders_error_in_the_caller() -> None:
    def load() -> None:
        raise FileNotFoundError("no model at /nowhere: give a GGUF file or a checkpoint dir")

    with pytest.raises(FileNotFoundError, match="no model at /nowhere"):
        apart(load)
    assert not any(t.name == "outrider-load" for t in threading.enumerate())
