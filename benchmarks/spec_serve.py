"""Speculation measured at the server: `outrider serve` plain, with EAGLE-3 and with n-gram
(the adaptive controller, as a user starts it), each load-tested by `outrider bench serve` on
the same prompts and concurrency sweep; one result file and the overlaid plots.

    python benchmarks/spec_serve.py [--concurrency 1 4 16 64] [--num-prompts 32]
                                    [--max-tokens 256] [--configs plain eagle3 ngram]
                                    [--rounds N] [--out NAME]

Each server is started, waited for (/health), swept, and stopped (SIGTERM) before the next, on
one port. With --rounds N the configurations take turns N times (plain, eagle3, ngram, plain,
...): a machine whose speed drifts (a shared CPU: +-5% from one run to the next) then weighs
on every configuration alike, and each speedup is the median of the rounds' own (each round's
configuration over that round's plain), every round's listed beside it.

Writes benchmarks/results/spec_serve.json (spec_serve_cpu.json without a GPU; `--out`): the
per-configuration `bench serve` results of the first round under `runs` (and every round's
under `rounds_runs`), the speedup of each over plain in output tokens/s and in median TPOT at
each concurrency, each server's start-up (the command to its first healthy answer) and its
ratio to plain's; and <out>_*.png (the first round). Speculative servers keep their step
profile in a folder of this run (OUTRIDER_STEP_PROFILES): the first round starts as on a fresh
machine (`startup_s`, measuring it), later rounds as a restart (`startup_restart_s`, reading it).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, metadata, start_server, write_result  # noqa: E402

CONFIGS = {"plain": [], "eagle3": ["--spec", "eagle3"], "ngram": ["--spec", "ngram"]}
PORT, KEY = 8011, "sk-bench"


def speedups(runs: dict, key: str, better_high: bool) -> dict[str, dict[str, float]]:
    """config -> {concurrency: its `key` over plain's (inverted for times: > 1 is faster)}."""
    base = {p["max_concurrency"]: p.get(key) for p in runs["plain"]["points"]}
    out = {}
    for name, run in runs.items():
        if name == "plain":
            continue
        row = {}
        for p in run["points"]:
            b, v = base.get(p["max_concurrency"]), p.get(key)
            if b and v:
                row[str(p["max_concurrency"])] = round(v / b if better_high else b / v, 3)
        out[name] = row
    return out


def median_speedups(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """config -> {concurrency: the median of the rounds' speedups there}."""
    out: dict[str, dict[str, float]] = {}
    for name in rounds[0]:
        points = {c for r in rounds for c in r.get(name, {})}
        out[name] = {
            c: round(statistics.median(r[name][c] for r in rounds if c in r.get(name, {})), 3)
            for c in sorted(points, key=int)
        }
    return out


def main() -> None:
    from outrider.bench.plot import load_results, plot_results
    from outrider.bench.prompts import load_prompts
    from outrider.bench.serve import BenchConfig, run
    from outrider.bench.serve import write_result as write_run

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="times the configurations take turns; speedups are the rounds' median",
    )  # fmt: skip
    ap.add_argument(
        "--out", default=None,
        help="result name (default spec_serve on a GPU machine, spec_serve_cpu without one)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.out is None:
        import torch

        args.out = "spec_serve" if torch.cuda.is_available() else "spec_serve_cpu"
    if "plain" not in args.configs:
        ap.error("--configs needs plain: every speedup is over it")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: use 1 or more")
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{PORT}", api_key=KEY, max_concurrency=tuple(args.concurrency),
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, temperature=0.0,
    )  # fmt: skip
    prompts = load_prompts(cfg)
    work = Path(tempfile.mkdtemp(prefix="spec-serve-"))  # per-run files and server logs
    os.environ["OUTRIDER_STEP_PROFILES"] = str(work / "step_profiles")  # the servers inherit it
    rounds: list[dict] = []  # each round's runs, by config
    starts: dict[str, list[float]] = {n: [] for n in args.configs}
    files = []
    for r in range(args.rounds):
        runs = {}
        for name in args.configs:
            log_path = work / f"server_{name}_{r}.log"
            t0 = time.monotonic()
            proc = start_server(["--api-key", KEY, *CONFIGS[name]], PORT, log_path)
            starts[name].append(round(time.monotonic() - t0, 2))  # to /health's first 200
            print(f"round {r} {name}: serving after {starts[name][-1]} s (log {log_path})",
                  flush=True)  # fmt: skip
            try:
                runs[name] = run(cfg, prompts, label=name, progress=False)
                # The commit the result itself records (benchmarks/.commit on a copied tree,
                # figures in results/ aside), not what `bench serve` read from git here.
                meta = metadata()
                runs[name].update(commit=meta["commit"], dirty=meta["dirty"])
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            if r == 0:
                files.append(write_run(runs[name], work))
            for p in runs[name]["points"]:
                print(f"{name:8s} C={p['max_concurrency']:<3} {p['output_throughput']:9.1f} "
                      f"tok/s  TPOT p50 {p.get('median_tpot_ms') or 0:7.2f} ms  accept "
                      f"{p.get('accept_length')}", flush=True)  # fmt: skip
        rounds.append(runs)
    plots = plot_results(load_results(files), RESULTS, prefix=f"{args.out}_")
    per_round = {
        "throughput": [speedups(runs, "output_throughput", True) for runs in rounds],
        "tpot": [speedups(runs, "median_tpot_ms", False) for runs in rounds],
    }
    startup = {n: ts[0] for n, ts in starts.items()}
    restart = {n: statistics.median(ts[1:]) for n, ts in starts.items() if len(ts) > 1}
    result = {
        "configs": {n: CONFIGS[n] for n in args.configs},
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "speedup_throughput": median_speedups(per_round["throughput"]),
        "speedup_tpot": median_speedups(per_round["tpot"]),
        "speedup_throughput_rounds": per_round["throughput"],
        "speedup_tpot_rounds": per_round["tpot"],
        "startup_s": startup,
        "startup_vs_plain": {n: round(t / startup["plain"], 2) for n, t in startup.items()},
        "startup_restart_s": restart,
        "startup_s_rounds": starts,
        "runs": rounds[0],
        "rounds_runs": rounds[1:],
        "plots": [p.name for p in plots],
    }
    print(write_result(args.out, result))


if __name__ == "__main__":
    main()
