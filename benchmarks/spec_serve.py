"""Speculation measured at the server: `outrider serve` plain, with EAGLE-3 and with n-gram
(the adaptive controller, as a user starts it), each load-tested by `outrider bench serve` on
the same prompts and concurrency sweep; one result file and the overlaid plots.

    python benchmarks/spec_serve.py [--concurrency 1 4 16 64] [--num-prompts 32]
                                    [--max-tokens 256] [--configs plain eagle3 ngram]
                                    [--request-rates R ...] [--dataset builtin|grounded]
                                    [--engine-c1] [--thread-profile] [--rounds N] [--waves W]
                                    [--out NAME] [--out-dir DIR]

Each server is started, waited for (/health), swept, and stopped (SIGTERM) before the next, on
one port. A sweep is the concurrency points, then one point per --request-rates R (Poisson
arrivals at R requests/s, at most --num-prompts in flight: the load a rate brings, not a cap).
Every point sends the same prompts (with --waves W, at least W x C of them at C, the first ones
repeated), so each meets them in the server's prefix cache (their TTFT
is a warm server's): a warm-up sweep, untimed, at 16 tokens a request, runs first (--no-warmup:
none, and the first point meets the kernels each batch size compiles at first use).
--dataset grounded loads the tasks on a text given in the prompt alone (where n-gram pays).
With --engine-c1 each configuration then runs through `LLM` at one stream on the same prompts
(spec_gpu.py's timed_run), the engine as a script sees it: the server's C=1 speedup over the
engine's is what the server path gives up. --thread-profile samples each server's threads
(where the engine thread and the event loop spend the time; beside an engine process, that
process's threads too, <out>_threads_<config>_<round>.txt.engine.txt). Under each point it
prints the engine's steps by kind (bench serve's engine_steps: ms a step, tokens a step, share
of the point), and after each server the line its controller logged as it stopped (decode steps
by k, acceptance, the step costs it timed live, why it speculates or not). With --rounds N the
configurations take turns N times (plain, eagle3, ngram, plain,
...): a machine whose speed drifts (a shared CPU: +-5% from one run to the next) then weighs
on every configuration alike, and each speedup is the median of the rounds' own (each round's
configuration over that round's plain), every round's listed beside it.

Writes benchmarks/results/spec_serve.json (spec_serve_cpu.json without a GPU; `--out`): the
per-configuration `bench serve` results of the first round under `runs` (and every round's
under `rounds_runs`; rate points under each run's `rate_points`), the speedup of each over
plain in output tokens/s and in median TPOT at each concurrency and rate, its median TTFT over
plain's (`ttft_over_plain`, > 1 is slower), with --engine-c1 `engine_c1`, `engine_speedup_c1`
and `server_share_of_engine_c1`, each server's start-up (the command to its first healthy answer) and its
ratio to plain's; and <out>_*.png (the first round). Speculative servers keep their step
profile in a folder of this run (OUTRIDER_STEP_PROFILES): the first round starts as on a fresh
machine (`startup_s`, measuring it), later rounds as a restart (`startup_restart_s`, reading it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, metadata, start_server, write_result  # noqa: E402

CONFIGS = {
    "plain": [],
    "eagle3": ["--spec", "eagle3"],
    "ngram": ["--spec", "ngram"],
    # Each step read before the next is launched (what running steps ahead gains, side by side).
    "eagle3_sync": ["--spec", "eagle3", "--no-async-scheduling"],
    "ngram_sync": ["--spec", "ngram", "--no-async-scheduling"],
    # The engine stepped in a thread of the server's process (what the engine process gains).
    "plain_thread": ["--no-engine-process"],
    "eagle3_thread": ["--spec", "eagle3", "--no-engine-process"],
    "ngram_thread": ["--spec", "ngram", "--no-engine-process"],
    # Steps with prompt chunks run eagerly, or with decode rows beside them replay graphs too
    # (what the PREFILL graphs change, side by side).
    "plain_eager_prefill": ["--cuda-graph-prefill-tokens", "0"],
    "eagle3_eager_prefill": ["--spec", "eagle3", "--cuda-graph-prefill-tokens", "0"],
    "ngram_eager_prefill": ["--spec", "ngram", "--cuda-graph-prefill-tokens", "0"],
    "plain_eager_mixed": ["--no-cuda-graph-mixed-prefill"],
    "eagle3_eager_mixed": ["--spec", "eagle3", "--no-cuda-graph-mixed-prefill"],
    "ngram_eager_mixed": ["--spec", "ngram", "--no-cuda-graph-mixed-prefill"],
}
DEFAULT_CONFIGS = ["plain", "eagle3", "ngram"]
PORT, KEY = 8011, "sk-bench"


def speedups(
    runs: dict, key: str, better_high: bool, points: str = "points", by: str = "max_concurrency"
) -> dict[str, dict[str, float]]:
    """config -> {point: its `key` over plain's (inverted for times: > 1 is faster)}, points
    named by their `by` (concurrency, or request_rate for `rate_points`)."""
    base = {p[by]: p.get(key) for p in runs["plain"].get(points, [])}
    out = {}
    for name, run in runs.items():
        if name == "plain":
            continue
        row = {}
        for p in run.get(points, []):
            b, v = base.get(p[by]), p.get(key)
            if b and v:
                row[str(p[by])] = round(v / b if better_high else b / v, 3)
        out[name] = row
    return out


def sweep(cfg, prompts_at: dict, label: str) -> dict:
    """`bench serve`'s run over cfg's concurrency points, point C sending prompts_at[C]: one
    run where every point sends the same prompts, else one run a point, merged into one."""
    from outrider.bench.serve import run

    points = cfg.max_concurrency
    if len({id(prompts_at[c]) for c in points}) == 1:
        return run(cfg, prompts_at[points[0]], label=label, progress=False)
    runs = [
        run(dataclasses.replace(cfg, max_concurrency=(c,)), prompts_at[c], label=label,
            progress=False)
        for c in points
    ]  # fmt: skip
    merged = dict(runs[0])
    merged["points"] = [r["points"][0] for r in runs]
    merged["config"] = dict(merged["config"], max_concurrency=list(points))
    return merged


def steps_line(ledger: dict) -> str:
    """A point's engine steps (bench serve's engine_steps) on one line: busy share, then each
    kind's steps x ms, tokens a step and share of the point's time."""
    kinds = "  ".join(
        f"{k} {v['steps']}x{v['ms_per_step']:.2f}ms {v['tokens_per_step']:.1f}tok "
        f"{v['time_share']:.0%}"
        for k, v in ledger["kinds"].items()
    )
    return f"engine busy {ledger['busy_share']:.0%}: {kinds}"


def round_speedups(runs: dict) -> dict[str, dict]:
    """One round's speedups: throughput and TPOT (> 1 faster) and TTFT over plain's (> 1
    slower), at each concurrency and each rate."""
    out = {}
    for kind, key, high in (
        ("throughput", "output_throughput", True),
        ("tpot", "median_tpot_ms", False),
        ("ttft_over_plain", "median_ttft_ms", True),
    ):
        out[kind] = speedups(runs, key, high)
        out[f"{kind}_rate"] = speedups(runs, key, high, "rate_points", "request_rate")
    return out


def engine_c1(configs: list[str], prompts: list, max_tokens: int) -> dict:
    """Each configuration through `LLM` at one stream, built as `outrider serve --spec NAME`
    builds its engine (default dtype, device and controller), on the bench's prompts as
    one-turn chats: tok/s and accept length (spec_gpu.py's timed_run)."""
    import torch
    from spec_gpu import timed_run

    from outrider import LLM, SamplingParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    convs = [[{"role": "user", "content": p.text}] for p in prompts]
    out = {}
    for name in configs:
        method, _, variant = name.partition("_")
        if variant == "thread" and method in out:  # the same engine: only the server differs
            out[name] = out[method]
            continue
        options = {"async_scheduling": False} if variant == "sync" else {}
        llm = LLM(speculative=None if method == "plain" else {"method": method}, **options)
        llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=8))  # kernels, graphs
        row = timed_run(llm, convs, 1, max_tokens, device)
        out[name] = {"tok_per_s": row["tok_per_s"], "accept_length": row["accept_length"]}
        print(f"engine   C=1   {name:8s} {row['tok_per_s']:9.1f} tok/s", flush=True)
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def median_speedups(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """config -> {concurrency: the median of the rounds' speedups there}."""
    out: dict[str, dict[str, float]] = {}
    for name in rounds[0]:
        points = {c for r in rounds for c in r.get(name, {})}
        out[name] = {
            c: round(statistics.median(r[name][c] for r in rounds if c in r.get(name, {})), 3)
            for c in sorted(points, key=float)
        }
    return out


def main() -> None:
    from outrider.bench.plot import load_results, plot_results
    from outrider.bench.prompts import load_prompts
    from outrider.bench.serve import BenchConfig, run
    from outrider.bench.serve import write_result as write_run
    from outrider.server.async_engine import SPECULATION_SUMMARY
    from outrider.server.stack_sampler import read_summary

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument(
        "--request-rates", type=float, nargs="*", default=[], metavar="R",
        help="Poisson arrival rates (requests/s), a point each after the concurrency sweep",
    )  # fmt: skip
    ap.add_argument("--dataset", default="builtin", choices=["builtin", "grounded"])
    ap.add_argument(
        "--warmup", action=argparse.BooleanOptionalAction, default=True,
        help="before timing a server, run the sweep once untimed at 16 tokens a request: the "
        "kernels each batch size compiles at first use (on a GPU, Triton's, cached on disk "
        "for the servers after) otherwise weigh on whichever server meets them first",
    )  # fmt: skip
    ap.add_argument(
        "--engine-c1", action="store_true",
        help="also each configuration through LLM at C=1: the server's speedup beside the engine's",
    )  # fmt: skip
    ap.add_argument(
        "--thread-profile", action="store_true",
        help="each server samples its threads' stacks (outrider/server/stack_sampler.py): "
        "where the engine thread and the event loop spend the time, printed after its points "
        "and kept as <out>_threads_<config>_<round>.txt",
    )  # fmt: skip
    ap.add_argument(
        "--waves", type=int, default=0,
        help="each concurrency point C sends at least WAVES x C prompts (the first --num-prompts "
        "repeated), so that a high C is timed over a steady load, not one ramp and tail (at C=64 "
        "an H100 ran 64 prompts in ~1.5 s, and plain's tok/s moved by 1.8x from one round to "
        "the next); 0: --num-prompts at every point",
    )  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="times the configurations take turns, in the order given and then reversed, "
        "round by round (a machine that drifts then favours none); speedups are the rounds' "
        "median",
    )  # fmt: skip
    ap.add_argument(
        "--out", default=None,
        help="result name (default spec_serve on a GPU machine, spec_serve_cpu without one)",
    )  # fmt: skip
    ap.add_argument("--out-dir", default=None, help="directory for the JSON and PNGs (e.g. $OUT)")
    args = ap.parse_args()
    if args.out is None:
        import torch

        args.out = "spec_serve" if torch.cuda.is_available() else "spec_serve_cpu"
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS
    if args.out.endswith(".json") or "/" in args.out:
        ap.error(f"--out {args.out}: give a name (no folder, no .json); --out-dir takes the folder")
    if args.num_prompts < 2 * max(args.concurrency):
        print(
            f"note: {args.num_prompts} prompts at C={max(args.concurrency)} make one wave at most;"
            f" its throughput is the wave's ramp and tail (--num-prompts "
            f"{2 * max(args.concurrency)} or more measures a steady load)",
            flush=True,
        )
    if "plain" not in args.configs:
        ap.error("--configs needs plain: every speedup is over it")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: use 1 or more")
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{PORT}", api_key=KEY, max_concurrency=tuple(args.concurrency),
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, temperature=0.0,
        dataset=args.dataset,
    )  # fmt: skip
    if any(r <= 0 for r in args.request_rates):
        ap.error(f"--request-rates {args.request_rates}: every rate must be positive")
    prompts = load_prompts(cfg)
    at_least = {c: max(args.num_prompts, args.waves * c) for c in args.concurrency}
    by_count = {args.num_prompts: prompts}  # more for a point C past it, the same ones first
    for n in set(at_least.values()) - {args.num_prompts}:
        by_count[n] = load_prompts(dataclasses.replace(cfg, num_prompts=n))
    prompts_at = {c: by_count[n] for c, n in at_least.items()}
    warm_prompts = [dataclasses.replace(p, max_tokens=min(16, p.max_tokens)) for p in prompts]
    work = Path(tempfile.mkdtemp(prefix="spec-serve-"))  # per-run files and server logs
    os.environ["OUTRIDER_STEP_PROFILES"] = str(work / "step_profiles")  # the servers inherit it
    rounds: list[dict] = []  # each round's runs, by config
    starts: dict[str, list[float]] = {n: [] for n in args.configs}
    files = []
    for r in range(args.rounds):
        runs = {}
        for name in args.configs if r % 2 == 0 else args.configs[::-1]:
            log_path = work / f"server_{name}_{r}.log"
            threads = out_dir / f"{args.out}_threads_{name}_{r}.txt"
            if args.thread_profile:  # the server writes it at shutdown (env.thread_profile)
                out_dir.mkdir(parents=True, exist_ok=True)
                os.environ["OUTRIDER_THREAD_PROFILE"] = str(threads)
            t0 = time.monotonic()
            proc = start_server(["--api-key", KEY, *CONFIGS[name]], PORT, log_path)
            starts[name].append(round(time.monotonic() - t0, 2))  # to /health's first 200
            print(f"round {r} {name}: serving after {starts[name][-1]} s (log {log_path})",
                  flush=True)  # fmt: skip
            try:
                if args.warmup:  # untimed: what each batch size compiles at its first use
                    run(cfg, warm_prompts, label=f"{name}-warmup", progress=False)
                if args.thread_profile:  # the samplers count afresh from here (stack_sampler)
                    Path(f"{threads}.restart").touch()
                    Path(f"{threads}.engine.restart").touch()  # the engine process's
                runs[name] = sweep(cfg, prompts_at, name)
                for rate in args.request_rates:  # the server stays up: one point each
                    at_rate = dataclasses.replace(
                        cfg, request_rate=rate, max_concurrency=(args.num_prompts,)
                    )
                    point = run(at_rate, prompts, label=name, progress=False)["points"][0]
                    runs[name].setdefault("rate_points", []).append(point)
                # The commit the result itself records (benchmarks/.commit on a copied tree,
                # figures in results/ aside), not what `bench serve` read from git here.
                meta = metadata()
                runs[name].update(commit=meta["commit"], dirty=meta["dirty"])
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
            said = SPECULATION_SUMMARY  # what the engine's controller did, as it stopped
            for line in log_path.read_text(errors="replace").splitlines():
                if said in line:
                    print(f"{name} round {r}: {line.split(said, 1)[1]}", flush=True)
            if args.thread_profile:
                print(f"{name} round {r}, where the server's threads were ({threads}):\n"
                      f"{read_summary(threads)}", flush=True)  # fmt: skip
                engine_threads = Path(f"{threads}.engine.txt")  # beside an engine process
                if engine_threads.exists():
                    print(f"and the engine process's ({engine_threads}):\n"
                          f"{read_summary(engine_threads)}", flush=True)  # fmt: skip
            if r == 0:
                files.append(write_run(runs[name], work))
            for p in runs[name]["points"] + runs[name].get("rate_points", []):
                at = (f"C={p['max_concurrency']:<3}" if p in runs[name]["points"]
                      else f"R={p['request_rate']}")  # fmt: skip
                ahead = (p.get("spec_decode") or {}).get("run_ahead_share")
                print(f"{name:8s} {at} {p['output_throughput']:9.1f} tok/s  TTFT p50 "
                      f"{p.get('median_ttft_ms') or 0:7.2f} ms  TPOT p50 "
                      f"{p.get('median_tpot_ms') or 0:7.2f} ms  accept {p.get('accept_length')}"
                      f"  run ahead {ahead}", flush=True)  # fmt: skip
                if p.get("engine_steps"):
                    print(f"{'':8s} {steps_line(p['engine_steps'])}", flush=True)
        rounds.append(runs)
    plots = plot_results(load_results(files), out_dir, prefix=f"{args.out}_")
    per_round = [round_speedups(runs) for runs in rounds]
    medians = {kind: median_speedups([r[kind] for r in per_round]) for kind in per_round[0]}
    engine = engine_c1(args.configs, prompts, args.max_tokens) if args.engine_c1 else None
    startup = {n: ts[0] for n, ts in starts.items()}
    restart = {n: statistics.median(ts[1:]) for n, ts in starts.items() if len(ts) > 1}
    result = {
        "configs": {n: CONFIGS[n] for n in args.configs},
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "prompts_at": at_least,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "dataset": args.dataset,
        "request_rates": args.request_rates,
        "speedup_throughput": medians["throughput"],
        "speedup_tpot": medians["tpot"],
        "ttft_over_plain": medians["ttft_over_plain"],
        "speedup_throughput_rate": medians["throughput_rate"],
        "speedup_tpot_rate": medians["tpot_rate"],
        "ttft_over_plain_rate": medians["ttft_over_plain_rate"],
        "speedup_throughput_rounds": [r["throughput"] for r in per_round],
        "speedup_tpot_rounds": [r["tpot"] for r in per_round],
        "startup_s": startup,
        "startup_vs_plain": {n: round(t / startup["plain"], 2) for n, t in startup.items()},
        "startup_restart_s": restart,
        "startup_s_rounds": starts,
        "runs": rounds[0],
        "rounds_runs": rounds[1:],
        "plots": [p.name for p in plots],
    }
    if engine is not None:
        base = engine["plain"]["tok_per_s"]
        speed = {n: round(r["tok_per_s"] / base, 3) for n, r in engine.items() if n != "plain"}
        server = medians["throughput"]
        result.update(
            engine_c1=engine, engine_speedup_c1=speed,
            server_share_of_engine_c1={
                n: round(server[n]["1"] / v, 3) for n, v in speed.items() if "1" in server[n]
            },
        )  # fmt: skip
    print(write_result(args.out, result, out_dir))


if __name__ == "__main__":
    main()
