"""Run a test module's `_worker()` under Triton's CPU interpreter and collect what it reports.

TRITON_INTERPRET=1 has to be set before triton is imported, so a module's kernel checks run in
one subprocess: the worker prints a line per check, `emit(...)` a JSON object after a marker,
and `run_worker` returns those objects (by name, or in order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "@@interpreter-result "


def emit(**line) -> None:
    """Report one check from inside a worker."""
    print(MARKER + json.dumps(line), flush=True)


def run_worker(module: str, timeout: float = 600) -> list[dict]:
    """`module`'s _worker() in a subprocess under the interpreter -> the lines it emitted, in
    order; the subprocess's failure (with its stderr's end) fails the caller."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", f"from {module} import _worker; _worker()"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [
        json.loads(line[len(MARKER) :])
        for line in proc.stdout.splitlines()
        if line.startswith(MARKER)
    ]
