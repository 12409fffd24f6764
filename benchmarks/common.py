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
