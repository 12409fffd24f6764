"""What every benchmark result carries: the command, commit, machine and versions."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# Written from a clean commit (`git rev-parse HEAD > benchmarks/.commit`) before a run on a
# machine that gets a copy of the tree without its history (the remote GPU machines), where git
# has no answer or a stale one: one line, the hash. Ignored by git.
COMMIT_FILE = Path(__file__).resolve().parent / ".commit"


def _known(commit: str) -> bool:
    """Whether this repository holds `commit` (False where there is no git or no such object)."""
    try:
        return (
            subprocess.run(
                ["git", "cat-file", "-e", f"{commit}^{{commit}}"],
                capture_output=True,
                cwd=RESULTS.parent,
            ).returncode
            == 0
        )
    except OSError:
        return False


def dirty_outside_results() -> bool:
    """Whether tracked files other than benchmarks/results/ differ from HEAD: a run's own
    figures, written before its JSON (spec_serve's plots), say nothing of the code it ran."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
             f":(top,exclude){RESULTS.parent.name}/{RESULTS.name}"],
            capture_output=True, text=True, cwd=RESULTS.parent, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return True
    return out.returncode != 0 or bool(out.stdout.strip())


def metadata() -> dict:
    import torch

    from outrider.bench.stats import git_commit

    def version(mod: str) -> str | None:
        try:
            return __import__(mod).__version__
        except Exception:
            return None

    commit, dirty = git_commit(RESULTS.parent)
    if dirty:
        dirty = dirty_outside_results()
    git = {"head": commit, "dirty": dirty}  # (None, None) with no repository here
    written = COMMIT_FILE.read_text().strip() if COMMIT_FILE.is_file() else ""
    if written and (commit is None or (commit != written and not _known(written))):
        # A copy of the tree whose .git (if any) never saw the file's commit: the remote
        # machines carry the session's first checkout beside the working tree. Where git knows
        # the commit (the repository it was written in, since moved on), git's answer stands.
        # Git's "dirty" there compares the copied tree with that stale checkout, which says
        # nothing of the run: it is not kept.
        git = {"head": commit, "tree": f"a copy of {written}'s, beside that checkout"}
        commit, dirty = written, False
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "dirty": dirty,
        "git_here": git,  # what git said where the benchmark ran
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": gpu,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "triton": version("triton"),
            "outrider": version("outrider"),
        },
    }


def write_result(name: str, payload: dict, directory: str | Path | None = None) -> Path:
    """Write `payload` and the run's metadata to `directory`/`name`.json (default
    benchmarks/results; a GPU run passes $OUT). A `directory` ending in .json is the file itself."""
    path = Path(directory) if directory is not None else RESULTS
    if path.suffix != ".json":
        path = path / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**metadata(), **payload}, indent=2) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), or None where matplotlib is not
    installed: a plotting benchmark then says so and writes its JSON without the PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", flush=True)
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    """Lay out, write (making its folder) and close a matplotlib figure, and say where."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def module_at(commit: str, path: str, name: str):
    """The module at `path` (from the repository's root) as it was at `commit`, imported from a
    temporary file as `name`: the code a change replaced, for a benchmark to run beside it."""
    source = subprocess.run(
        ["git", "show", f"{commit}:{path}"],
        capture_output=True, text=True, check=True, cwd=RESULTS.parents[1],
    ).stdout  # fmt: skip
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def start_server(
    args: list[str], port: int, log: Path, timeout: float = 300.0, host: str = "127.0.0.1"
) -> subprocess.Popen:
    """`outrider serve --host host --port port *args` with its output in `log`, once its
    /health answers 200; RuntimeError when it exits first or does not answer in `timeout` s."""
    cmd = [sys.executable, "-m", "outrider", "serve", "--host", host, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log}")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout} s: see {log}")


def time_graph(fn, reps: int = 10) -> float:
    """Median ms of one call of `fn` (CUDA), from a CUDA graph of `reps` calls replayed five
    times: what a kernel costs inside the engine's graphs, launches not counted."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[2]


def kernel_spans(prof) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU kernel, copy and fill a torch.profiler run saw
    (kernels replayed inside CUDA graphs included), sorted by start."""
    from torch.autograd import DeviceType

    return sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )


def _gaps(spans: list[tuple[float, float]], host_gap_us: float) -> tuple[float, float, float]:
    """Microseconds the device spent busy (the union of `spans`, sorted by start) and idle
    between them, the idle split into gaps shorter than `host_gap_us` (one kernel launched
    after another, inside a graph replay) and longer ones (the device waiting on the host):
    (busy, short, long)."""
    busy = short = long = 0.0
    start = end = None
    for s, e in spans:
        if end is not None and s > end:
            busy += end - start
            gap = s - end
            if gap < host_gap_us:
                short += gap
            else:
                long += gap
            start = s
        elif start is None:
            start = s
        end = e if end is None else max(end, e)
    if end is not None:
        busy += end - start
    return busy, short, long


def idle_per_step(spans: list[tuple[float, float]], steps: int, host_gap_us: float = 20.0) -> dict:
    """Where the device waits in a stretch of `steps` steps, per step: launch gaps (shorter
    than `host_gap_us`) and host gaps (longer), in milliseconds."""
    _, short, long = _gaps(spans, host_gap_us)
    return {
        "launch_gaps_ms_per_step": round(short / 1e3 / steps, 3),
        "host_gaps_ms_per_step": round(long / 1e3 / steps, 3),
    }


def device_idle(spans: list[tuple[float, float]], host_gap_us: float = 20.0) -> dict:
    """What share of a profiled stretch, from its first kernel's start to its last one's end,
    the device sat idle, and of that the launch gaps (shorter than `host_gap_us`) and the host
    gaps (longer)."""
    if not spans:
        raise ValueError("no GPU kernels were recorded: profile a CUDA run")
    busy, short, long = _gaps(spans, host_gap_us)
    window = max(e for _, e in spans) - spans[0][0]
    return {
        "window_ms": round(window / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_fraction": round((short + long) / window, 4),
        "launch_gaps_fraction": round(short / window, 4),
        "host_gaps_fraction": round(long / window, 4),
    }
