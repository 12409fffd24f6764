"""How long the `outrider` command takes before it does anything: `--help`, `serve --help` and an
argument error, each run in a fresh interpreter (what a user or a systemd unit pays per call).

    python benchmarks/cli_startup.py [--repeat 5] [--ref COMMIT] [--out PATH]

Each case runs `python -m outrider ARGS` --repeat times in a subprocess and records the wall
seconds of every run and their median. --ref also times the `outrider/` package as it was at
COMMIT (exported with `git archive` into a temporary directory, which `python -m` then imports
from), the two trees alternating run by run so both see the same machine state.
Writes benchmarks/results/cli_startup.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "help": ["--help"],
    "serve_help": ["serve", "--help"],
    "argument_error": ["generate", "--spec", "bogus", "x"],
}


def export_tree(commit: str) -> tuple[Path, str]:
    """`outrider/` at `commit` in a temporary directory, and the commit's full hash."""
    full = subprocess.run(
        ["git", "rev-parse", commit], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    out = Path(tempfile.mkdtemp(prefix="outrider-ref-"))
    archive = subprocess.run(
        ["git", "archive", full, "outrider"], capture_output=True, check=True, cwd=ROOT
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out, full


def time_once(tree: Path, args: list[str]) -> tuple[float, int]:
    """Wall seconds of one `python -m outrider ARGS` run from `tree`, and its exit status."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "outrider", *args], cwd=tree, capture_output=True, text=True
    )
    return time.perf_counter() - t0, r.returncode


def imported_from(tree: Path) -> str:
    """Where `python -m outrider` run from `tree` imports the package (a check on --ref)."""
    code = "import outrider, os; print(os.path.dirname(outrider.__file__))"
    r = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True)
    return r.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per case (default: 5)")
    ap.add_argument("--ref", default=None, help="also time outrider/ at this commit")
    ap.add_argument("--out", default=None, help="result file or directory")
    args = ap.parse_args()

    trees = {"tree": ROOT}
    ref_commit = None
    if args.ref:
        trees["ref"], ref_commit = export_tree(args.ref)
    for name, tree in trees.items():
        where = imported_from(tree)
        if Path(where) != tree / "outrider":
            raise SystemExit(f"{name}: `python -m outrider` imports {where}, not {tree}/outrider")

    runs: dict[str, dict[str, list[float]]] = {t: {c: [] for c in CASES} for t in trees}
    codes: dict[str, dict[str, int]] = {t: {} for t in trees}
    for case, argv in CASES.items():
        for _ in range(args.repeat):
            for name, tree in trees.items():  # alternate the trees run by run
                seconds, rc = time_once(tree, argv)
                runs[name][case].append(round(seconds, 4))
                codes[name][case] = rc
    results = {
        name: {
            case: {
                "argv": CASES[case],
                "median_s": round(statistics.median(runs[name][case]), 4),
                "runs_s": runs[name][case],
                "returncode": codes[name][case],
            }
            for case in CASES
        }
        for name in trees
    }
    payload = {"repeat": args.repeat, "python": sys.executable, "tree": results["tree"]}
    if ref_commit:
        payload["ref"] = {"commit": ref_commit, **results["ref"]}
    path = write_result("cli_startup", payload, args.out)
    for name in trees:
        label = "this tree" if name == "tree" else f"ref {ref_commit[:9]}"
        medians = ", ".join(f"{c} {results[name][c]['median_s']:.2f} s" for c in CASES)
        print(f"{label}: {medians}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
