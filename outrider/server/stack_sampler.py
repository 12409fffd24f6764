"""Where the server's threads spend their time: every `interval` seconds a background thread
records the Python stack of each other thread (sys._current_frames), and counts each distinct
stack. The engine thread's host work and the event loop's (HTTP, streaming) share the GIL, so
when the server gives up part of the engine's speed these counts say which of them, in what.

    OUTRIDER_THREAD_PROFILE=/tmp/p.txt outrider serve ...   # written at shutdown
    touch /tmp/p.txt.restart                                # counts start afresh now
    benchmarks/spec_serve.py --thread-profile               # one per server, its timed part

The file holds a summary (per thread: its samples, the frames it was in most, itself and
below) and then collapsed stacks, one line each ("thread;file:function;... count", root first:
what flame-graph tools read). Each thread's line gives its CPU seconds over the same time
(its own clock, `time.pthread_getcpuclockid`) beside the wall seconds: an engine thread and an
event loop whose CPU adds up to about the wall share one interpreter to the full, and no sample
shows that. Sampling costs one stack walk a thread per interval (about
30 us at three threads), taken with the GIL: at 2 ms about 1.5% of the process."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter

RESTART_CHECK = 25  # samples between looks for the restart file


class StackSampler:
    def __init__(self, interval: float = 0.002, restart: str | None = None) -> None:
        """restart: a path whose appearance (checked every RESTART_CHECK samples) clears the
        counts and is then removed: a benchmark marks the start of what it times."""
        if interval <= 0:
            raise ValueError(f"invalid interval={interval}: use seconds > 0, e.g. 0.002")
        self.interval, self.restart = interval, restart
        self.stacks: Counter[tuple[str, ...]] = Counter()  # (thread, frames root first...)
        self.samples = 0
        self._since = time.monotonic()  # wall clock at the first sample counted
        self._last = self._since  # and at the last: a summary covers what lies between
        self._cpu0: dict[str, float] = {}  # thread name -> its CPU seconds then
        self._cpu: dict[str, float] = {}  # thread name -> its CPU seconds at the last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        own = threading.get_ident()
        while not self._stop.wait(self.interval):
            frames = sys._current_frames()
            # (each sample: a thread's ident is reused once it has ended)
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in frames.items():
                if tid != own:
                    name = names.get(tid, str(tid))
                    self.stacks[(name, *_frames(frame))] += 1
                    cpu = _cpu_seconds(tid)
                    if cpu is not None:
                        self._cpu0.setdefault(name, cpu)
                        self._cpu[name] = cpu
            self.samples += 1
            self._last = time.monotonic()
            if self.restart and self.samples % RESTART_CHECK == 0 and os.path.exists(self.restart):
                self.stacks.clear()
                self.samples = 0
                self._since = self._last = time.monotonic()
                self._cpu0 = dict(self._cpu)
                os.remove(self.restart)

    def summary(self, top: int = 12) -> str:
        """Per thread: samples, then the frames it spent most samples in, itself (self) and
        with what it called (total, less the frames of every sample)."""
        wall = self._last - self._since  # the same whenever it is read once sampling stops
        lines = [f"{self.samples} samples every {self.interval * 1e3:g} ms over {wall:.2f} s"]
        threads: Counter[str] = Counter()
        own: dict[str, Counter[str]] = {}
        total: dict[str, Counter[str]] = {}
        for (thread, *frames), n in self.stacks.items():
            threads[thread] += n
            if frames:
                own.setdefault(thread, Counter())[frames[-1]] += n
            for f in set(frames):
                total.setdefault(thread, Counter())[f] += n
        for thread, n in threads.most_common():
            cpu = self._cpu.get(thread, 0.0) - self._cpu0.get(thread, 0.0)
            lines.append(
                f"thread {thread}: {n} samples, CPU {cpu:.2f} s of {wall:.2f} s wall "
                f"({100 * cpu / max(wall, 1e-9):.0f}%)"
            )
            for f, c in own.get(thread, Counter()).most_common(top):
                lines.append(f"  self  {100 * c / n:5.1f}%  {f}")
            # (frames in every sample, the thread's entry, say nothing)
            below = [(f, c) for f, c in total.get(thread, Counter()).most_common() if c < n]
            for f, c in below[:top]:
                lines.append(f"  total {100 * c / n:5.1f}%  {f}")
        return "\n".join(lines)

    def write(self, path: str | os.PathLike) -> None:
        collapsed = (f"{';'.join(s)} {n}" for s, n in self.stacks.most_common())
        with open(path, "w") as f:
            f.write(self.summary() + "\n\n" + "\n".join(collapsed) + "\n")


def _frames(frame) -> list[str]:
    """A stack as file:function labels, root first."""
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return out[::-1]


def _cpu_seconds(ident: int) -> float | None:
    """The CPU seconds of the thread `ident` so far; None where the platform has no per-thread
    clock or the thread has just ended."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):
        return None


def read_summary(path: str | os.PathLike) -> str:
    """The summary part of a file `write` wrote."""
    with open(path) as f:
        return f.read().split("\n\n", 1)[0]
