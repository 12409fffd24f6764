"""Load a script from benchmarks/ as a module, as its tests need: benchmarks are scripts, not a
package, and they put benchmarks/ on sys.path for their shared `common` when they run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(filename: str) -> ModuleType:
    """benchmarks/`filename` executed as the module bench_<stem>; sys.path is left as it was,
    and the module is registered while it executes (dataclasses look their module up)."""
    name = "bench_" + Path(filename).stem
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    module = importlib.util.module_from_spec(spec)
    path_before = list(sys.path)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path_before
        del sys.modules[name]
    return module
