"""What every benchmark result carries: the command, commit, machine and versions."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
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


def metadata() -> dict:
    import torch

    from outrider.bench.stats import git_commit

    def version(mod: str) -> str | None:
        try:
            return __import__(mod).__version__
        except Exception:
            return None

    commit, dirty = git_commit(RESULTS.parent)
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


def save_figure(fig, path: Path) -> None:
    """Lay out, write (making its folder) and close a matplotlib figure, and say where."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
