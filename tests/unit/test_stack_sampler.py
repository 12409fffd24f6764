"""The server's stack sampler: which thread spends its samples where."""

from __future__ import annotations

import threading
import time

import pytest

from outrider.server.stack_sampler import StackSampler, read_summary


def spin_here(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_thread_shows_where_it_spins(tmp_path):
    sampler = StackSampler(interval=0.001).start()
    busy = threading.Thread(target=spin_here, args=(0.3,), name="busy")
    busy.start()
    busy.join()
    sampler.stop()
    assert sampler.samples > 20
    summary = sampler.summary()
    lines = summary.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("thread busy:")))
    selfs = [line for line in lines[at + 1 :] if line.startswith("  self")]
    assert "test_stack_sampler.py:spin_here" in selfs[0]  # its most sampled frame
    assert float(selfs[0].split()[1].rstrip("%")) > 50
    path = tmp_path / "p.txt"
    sampler.write(path)
    assert read_summary(path) == summary
    collapsed = path.read_text().split("\n\n", 1)[1].splitlines()
    stack, count = collapsed[0].rsplit(" ", 1)
    assert int(count) > 0 and ";" in stack
    assert any(s.startswith("busy;") and s.split(" ")[0].endswith(":spin_here") for s in collapsed)


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval=0"):
        StackSampler(interval=0)


def test_the_restart_file_clears_what_came_before(tmp_path):
    """A benchmark touches the restart file where its timed part starts: counts from before it
    (a thread busy in another function) are gone, and the file is removed."""
    marker = tmp_path / "p.txt.restart"
    sampler = StackSampler(interval=0.001, restart=str(marker)).start()
    first = threading.Thread(target=spin_here, args=(0.15,), name="before")
    first.start()
    first.join()
    marker.touch()
    for _ in range(200):  # looked for every RESTART_CHECK samples
        if not marker.exists():
            break
        time.sleep(0.01)
    assert not marker.exists()
    after = threading.Thread(target=spin_here, args=(0.1,), name="after")
    after.start()
    after.join()
    sampler.stop()
    threads = {stack[0] for stack in sampler.stacks}
    assert "after" in threads and "before" not in threads


def test_each_thread_shows_its_cpu_seconds_beside_the_wall():
    """A thread that spins has used about as much CPU as wall time; one that sleeps, about
    none: what tells an interpreter shared to the full from threads that wait."""
    sampler = StackSampler(interval=0.001).start()
    busy = threading.Thread(target=spin_here, args=(0.3,), name="busy")
    idle = threading.Thread(target=time.sleep, args=(0.3,), name="idle")
    busy.start(), idle.start()
    busy.join(), idle.join()
    sampler.stop()
    cpu = {}
    for line in sampler.summary().splitlines():
        if line.startswith("thread "):
            name = line.split(":")[0].removeprefix("thread ")
            cpu[name] = float(line.split("CPU ")[1].split(" s")[0])
    assert cpu["busy"] > 0.15
    assert cpu["idle"] < 0.05
