"""Run a test module's `_worker()` under Triton's CPU interpreter and collect what it reports.

TRITON_INTERPRET=1 has to be set before triton is imported, so a module's kernel checks run in
one subprocess: the worker prints a line per check, `emit(...)` a JSON object after a marker,
and `run_worker` returns those objects (by name, or in order)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
MARKER = "@@interpreter-result "


def emit(**line) -> None:
    """Report one check from inside a worker."""
    print(MARKER + json.dumps(line), flush=True)


def run_worker(module: str, timeout: float = 600, parts: list[str] | None = None) -> list[dict]:
    """`module`'s _worker() in a subprocess under the interpreter -> the lines it emitted, in
    order; the subprocess's failure (with its stderr's end) fails the caller. parts: run
    _worker(part) for each in subprocesses of their own, as many at once as there are cores
    (the interpreter is one Python thread), started in the order given (the longest first
    keeps the cores evenly busy), and return their lines in the parts' order."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    calls = [f"_worker({part!r})" for part in parts] if parts else ["_worker()"]
    pending = list(enumerate(calls))
    running: dict[int, tuple[subprocess.Popen, IO, IO]] = {}  # output in files: no pipe fills
    out: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as files:
        try:
            while pending or running:
                while pending and len(running) < max(1, os.cpu_count() or 1):
                    i, call = pending.pop(0)
                    stdout = files.enter_context(tempfile.TemporaryFile("w+"))
                    stderr = files.enter_context(tempfile.TemporaryFile("w+"))
                    proc = subprocess.Popen(
                        [sys.executable, "-c", f"from {module} import _worker; {call}"],
                        cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True,
                    )  # fmt: skip
                    running[i] = (proc, stdout, stderr)
                # Whichever part ends first frees its core: parts differ in length.
                ended = [i for i, (proc, _, _) in running.items() if proc.poll() is not None]
                if not ended:
                    if time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(calls[next(iter(running))], timeout)
                    time.sleep(0.05)
                    continue
                i = ended[0]
                proc, stdout, stderr = running.pop(i)
                stdout.seek(0), stderr.seek(0)
                assert proc.returncode == 0, f"{calls[i]}: {stderr.read()[-3000:]}"
                out[i] = stdout.read()
        finally:
            for proc, _, _ in running.values():
                proc.kill()
    return [
        json.loads(line[len(MARKER) :])
        for i in sorted(out)
        for line in out[i].splitlines()
        if line.startswith(MARKER)
    ]
