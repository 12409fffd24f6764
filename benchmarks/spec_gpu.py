"""Speculative decoding as a user runs it (`outrider.LLM`, greedy), side by side with plain
decoding in one run: n-gram and EAGLE-3 (chain, tree), fixed and adaptive controller, over a
concurrency sweep, on the held-out and the input-grounded prompt sets.

    python benchmarks/spec_gpu.py [--configs ngram eagle3_chain] [--sets heldout grounded]
        [--concurrency 1 2 4 ...] [--new-tokens 256] [--k 4] [--rounds 3] [--min-batches 2]
        [--draft DIR] [--device cpu]
        [--out NAME] [--out-dir DIR] [--plot PATH]

Each (config, set, C) runs the set's prompts as one-turn chats in batches of C requests (the
prompt list cycled so every batch holds C); all configurations are built first and each (set, C)
runs plain, then `--rounds` rounds of every configuration (rotated order) each followed by plain
(a round's speedup is over the mean of the plain runs around it, so drift cancels; the median
over rounds is reported). It reports tok/s, accept length, speedup,
the fraction of outputs identical to plain's and the median first-divergence position. Writes
benchmarks/results/spec_gpu.json (CPU: spec_cpu_sweep.json) and a PNG of speedup against C.

--device-idle C [C ...] (CUDA) then runs one batch of C prompts per configuration under
torch.profiler (GPU activity only) and reports the share of that stretch, first kernel to last,
the device sat idle: launch gaps (under 20 us, between kernels of one replay) and host gaps (the
device waiting on the host), beside the steps by k the stretch ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_idle, kernel_spans, pyplot, save_figure, write_result  # noqa: E402

CONFIGS = (
    "ngram", "eagle3_chain", "eagle3_tree", "adaptive_ngram", "adaptive_eagle3",
    # The same with async scheduling off: each step read before the next is launched (what
    # running a step ahead gains, side by side).
    "eagle3_chain_sync", "eagle3_tree_sync", "ngram_sync", "adaptive_ngram_sync",
    "adaptive_eagle3_sync",
)  # fmt: skip
SUMMARY_KEYS = {"heldout": "speedup", "grounded": "speedup_grounded"}


def spec_configs(
    k: int, draft: str | None, tree: tuple[int, int, int] = (8, 3, 4)
) -> dict[str, dict | None]:
    """Config name -> the `speculative=` dict given to `LLM` (None: plain decoding; a name
    ending in _sync: async scheduling off); `tree`: (nodes, topk, steps) of the eagle3_tree
    configuration."""
    eagle = {"method": "eagle3", "draft": draft}
    nodes, topk, steps = tree
    configs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_draft_tokens": k, "controller": "fixed"},
        "eagle3_chain": {**eagle, "num_draft_tokens": k, "controller": "fixed"},
        "eagle3_tree": {**eagle, "num_draft_tokens": nodes, "topk": topk, "num_steps": steps,
                        "controller": "fixed"},
        "adaptive_ngram": {"method": "ngram", "num_draft_tokens": k, "controller": "adaptive"},
        "adaptive_eagle3": {**eagle, "num_draft_tokens": k, "controller": "adaptive"},
    }  # fmt: skip
    synced = {f"{n}_sync": spec for n, spec in configs.items() if f"{n}_sync" in CONFIGS}
    return {**configs, **synced}


def batches(items: list, c: int, min_batches: int = 1) -> list[list]:
    """Batches of exactly c, cycling `items` so the last (or only, when c > len) one is full,
    and at least min_batches of them: 5 items, c=2 -> [0 1] [2 3] [4 0]; 2 items, c=5 ->
    [0 1 0 1 0]; 2 items, c=2, min_batches=2 -> [0 1] [0 1]."""
    total = max(-(-len(items) // c), min_batches) * c
    cycled = [items[i % len(items)] for i in range(total)]
    return [cycled[i : i + c] for i in range(0, total, c)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token id (the shorter length if one is a prefix of the
    other); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity_summary(ids: list[list[int]], plain_ids: list[list[int]]) -> dict:
    """How far speculative outputs match plain's, output by output (same requests, same order)."""
    if len(ids) != len(plain_ids):
        raise ValueError(f"{len(ids)} outputs against {len(plain_ids)} plain ones: same requests?")
    div = [d for d in map(first_divergence, ids, plain_ids) if d is not None]
    return {
        "same_output_fraction": round(1 - len(div) / len(ids), 3) if ids else None,
        "median_first_divergence": statistics.median(div) if div else None,
    }


def summary_tables(runs: dict) -> dict:
    """From runs {f"{set}_c{C}": {config: row}}: plain tok/s by set and C, and per set in
    SUMMARY_KEYS the speedup over plain by non-plain config and C (C as a string: JSON keys)."""
    out: dict = {key: {} for key in SUMMARY_KEYS.values()}
    out["plain_tok_per_s"] = {}
    for run_key, rows in runs.items():
        set_name, c = run_key.rsplit("_c", 1)
        if "plain" in rows:
            out["plain_tok_per_s"].setdefault(set_name, {})[c] = rows["plain"]["tok_per_s"]
        if set_name not in SUMMARY_KEYS:
            continue
        for name, row in rows.items():
            if name != "plain" and row.get("speedup") is not None:
                out[SUMMARY_KEYS[set_name]].setdefault(name, {})[c] = row["speedup"]
    return out


def step_split(before: dict, after: dict) -> dict | None:
    """Per engine step over a timed part, from a runner clock's totals: milliseconds inside the
    runner (forwards, acceptance, drafting and the one host read, so the GPU's time shows
    here) and the rest of the step on the host (scheduling, proposing, the controller,
    detokenizing); steps by k verified (0: plain)."""
    steps = after["steps"] - before["steps"]
    if not steps:
        return None
    runner = after["runner_s"] - before["runner_s"]
    total = after["step_s"] - before["step_s"]
    by_k = {k: n - before["by_k"].get(k, 0) for k, n in after["by_k"].items()}
    return {
        "runner_ms": round(runner / steps * 1e3, 3),
        "host_ms": round((total - runner) / steps * 1e3, 3),
        "steps": steps,
        "steps_by_k": {str(k): n for k, n in sorted(by_k.items()) if n},
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()  # CPU-GPU sync point: the timed part ends when the GPU does


def _clock(engine) -> dict:
    """Totals of a clock wrapped once around `engine.step` and the runner's calls: seconds in
    steps, seconds in the runner, steps; and the engine's steps by k."""
    totals = getattr(engine, "_bench_clock", None)
    if totals is None:
        totals = engine._bench_clock = {"steps": 0, "step_s": 0.0, "runner_s": 0.0}

        def timed(fn, key):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    totals[key] += time.perf_counter() - t0
                    totals["steps"] += key == "step_s"

            return wrapper

        engine.step = timed(engine.step, "step_s")
        for name in ("run", "run_spec", "launch"):
            setattr(engine.runner, name, timed(getattr(engine.runner, name), "runner_s"))
    return {**totals, "by_k": dict(engine.speculator.steps_by_k)}


def _json_safe(x):
    return json.loads(json.dumps(x, default=str))


def timed_run(llm, convs: list, c: int, new_tokens: int, device: str, min_batches: int = 1) -> dict:
    """All of `convs` in batches of c (at least min_batches); tok/s over the timed part,
    accept length, step split."""
    from outrider import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    engine = llm.engine
    before = _clock(engine)
    _sync(device)
    outs, t0 = [], time.perf_counter()
    for batch in batches(convs, c, min_batches):
        outs += llm.chat(batch, params)
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    verify = sum(o.metrics.get("num_verify_steps") or 0 for o in outs)
    accepted = sum(o.metrics.get("num_accepted_tokens") or 0 for o in outs)
    split = step_split(before, _clock(engine))
    controller = engine.speculator.controller  # None: plain, fixed k or trees
    return {
        "requests": len(outs),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 2),
        "accept_length": round(1 + accepted / verify, 3) if verify else None,
        "step_split": split,
        "controller": _json_safe(controller.snapshot()) if controller is not None else None,
        "ids": [o.token_ids for o in outs],
    }


def profiled_run(llm, convs: list, c: int, new_tokens: int) -> dict:
    """One batch of c of `convs` under torch.profiler, GPU activity only: the share of the
    stretch the device sat idle (common.device_idle) and the engine's steps by k in it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from outrider import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    before = _clock(llm.engine)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outs = llm.chat(batches(convs, c)[0], params)
        torch.cuda.synchronize()  # CPU-GPU sync point: the stretch ends when the GPU does
    return {
        **device_idle(kernel_spans(prof)),
        "tokens": sum(len(o.token_ids) for o in outs),
        "step_split": step_split(before, _clock(llm.engine)),
    }


def summarize(tries: list[dict]) -> dict:
    """One configuration's rounds -> its row: speedup = the median over rounds of its tok/s
    over the mean of the two plain runs around that round (each round runs every
    configuration once, in a rotated order), tok/s the median; the rest from the last round."""
    speedups = [t["tok_per_s"] / statistics.mean(p["tok_per_s"] for p in t["plain_around"])
                for t in tries]  # fmt: skip
    # The same requests' wall time against plain's: bf16 outputs meet EOS at other places than
    # plain's, so a run's token count differs from plain's (one at C=32 held 2% fewer tokens
    # in 4% less time: 0.98x in tok/s, 1.04x in time). Reported beside, not instead.
    times = [statistics.mean(p["seconds"] for p in t["plain_around"]) / t["seconds"] for t in tries]
    row = {k: v for k, v in tries[-1].items() if k != "plain_around"}
    row["ids"] = tries[0]["ids"]
    row.update(
        tok_per_s=round(statistics.median(t["tok_per_s"] for t in tries), 2),
        speedup=round(statistics.median(speedups), 3),
        speedup_rounds=[round(x, 3) for x in speedups],
        speedup_time=round(statistics.median(times), 3),
        tokens_vs_plain=round(tries[-1]["tokens"] / tries[-1]["plain_around"][0]["tokens"], 4),
    )
    return row


def plot(runs_summary: dict, sets: list[str], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        table = runs_summary.get(SUMMARY_KEYS.get(set_name, ""), {})
        for name, by_c in table.items():
            cs = sorted(by_c, key=int)
            ax.plot([int(c) for c in cs], [by_c[c] for c in cs], marker="o", label=name)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ticks = sorted({int(c) for by_c in table.values() for c in by_c})
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set(title=set_name, xlabel="concurrency (requests per batch)", ylabel="speedup vs plain")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help="speculative configs to run (plain always runs)",
    )
    ap.add_argument(
        "--sets", nargs="+", choices=("heldout", "grounded"), default=["heldout", "grounded"]
    )
    ap.add_argument("--num-prompts", type=int, default=None, help="cap on prompts per set")
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="requests per batch (default GPU 1 2 4 8 16 32 64, CPU 1 4)",
    )
    ap.add_argument("--new-tokens", type=int, default=None, help="default GPU 256, CPU 64")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (chain configs)")
    ap.add_argument(
        "--tree",
        type=int,
        nargs=3,
        default=[8, 3, 4],
        metavar=("NODES", "TOPK", "STEPS"),
        help="the eagle3_tree configuration's shape (default 8 3 4)",
    )
    ap.add_argument(
        "--rounds", type=int, default=None,
        help="rounds per (set, C), each running every configuration once between plain runs "
        "(default GPU 3: one batch of 64 takes ~0.5 s there, and two plain runs in a row "
        "differed by up to 13%%; CPU 1)",
    )  # fmt: skip
    ap.add_argument(
        "--min-batches", type=int, default=None,
        help="batches of C each timed run serves at least, prompts cycled (default GPU 2: at "
        "C=32 and 64 the 30 prompts are one batch, a 0.5 s run, and plain runs of one slot "
        "varied 20%%; CPU 1)",
    )  # fmt: skip
    ap.add_argument(
        "--device-idle", type=int, nargs="+", default=[], metavar="C",
        help="after the sweep, profile one batch of C prompts per configuration (CUDA): the "
        "share of it the device sat idle",
    )  # fmt: skip
    ap.add_argument("--draft", default=None, help="EAGLE-3 drafter dir (default: the shipped one)")
    ap.add_argument("--model", default=None, help="target model (default: the embedded one)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="result name (default spec_gpu / spec_cpu_sweep)")
    ap.add_argument("--out-dir", default=None, help="directory for the JSON (e.g. $OUT)")
    ap.add_argument("--plot", default=None, help="PNG path (default: beside the JSON)")
    args = ap.parse_args()

    from outrider import LLM, SamplingParams
    from outrider.bench.datasets import GROUNDED, HELDOUT

    cuda = args.device.startswith("cuda")
    concurrency = args.concurrency or ([1, 2, 4, 8, 16, 32, 64] if cuda else [1, 4])
    new_tokens = args.new_tokens or (256 if cuda else 64)
    args.rounds = args.rounds or (3 if cuda else 1)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: use 1 or more")
    args.min_batches = args.min_batches or (2 if cuda else 1)
    if args.min_batches < 1:
        ap.error(f"--min-batches {args.min_batches}: use 1 or more")
    mb = args.min_batches
    if args.device_idle and not cuda:
        ap.error(f"--device-idle needs a CUDA device, not --device {args.device}")
    if any(c < 1 for c in args.device_idle):
        ap.error(f"--device-idle {args.device_idle}: batch sizes of 1 or more")
    name = args.out or ("spec_gpu" if cuda else "spec_cpu_sweep")
    prompt_sets = {"heldout": HELDOUT, "grounded": GROUNDED}
    convs = {s: [[{"role": "user", "content": p}] for p in prompt_sets[s][: args.num_prompts]]
             for s in args.sets}  # fmt: skip
    all_specs = spec_configs(args.k, args.draft, tuple(args.tree))
    specs = {n: all_specs[n] for n in ["plain", *args.configs]}
    # Every configuration lives side by side, and each (set, C) slot runs plain, then rounds
    # of every configuration (rotated) each followed by plain: a configuration is compared
    # with the mean of the two plain runs around its round, so drift over a long sweep (seen:
    # 20% on a shared 2-core VM, 30% between GPU hosts) does not land on whichever
    # configuration ran last, and the median over rounds drops a one-off stall. A fixed pool
    # (4096 blocks of 16 tokens, 1.5 GiB for the default model) lets six engines share a GPU.
    memory = {"num_blocks": 4096} if cuda else {}
    runs: dict = {}
    plain_ids: dict[str, list] = {}
    errors: dict[str, str] = {}
    llms = {}
    for cfg, spec in specs.items():
        try:
            sync = {"async_scheduling": False} if cfg.endswith("_sync") else {}
            llm = LLM(
                args.model, dtype=args.dtype, device=args.device, speculative=spec, **memory,
                **sync,
            )  # fmt: skip
        except Exception as e:  # record and go on: one drafter missing should not cost the sweep
            if cfg == "plain":
                raise
            errors[cfg] = f"{type(e).__name__}: {e}"
            print(f"{cfg:16s} failed to build: {errors[cfg]}", flush=True)
            continue
        warm = batches(next(iter(convs.values())), max(concurrency))[0]
        llm.chat(warm, SamplingParams(temperature=0, max_tokens=16))  # kernels, graphs, autotune
        llms[cfg] = llm
    print(f"{'config':16s} {'run':14s} {'tok/s':>9s} {'speedup':>8s} {'accept':>7s} "
          f"{'same':>6s} {'div@':>6s}", flush=True)  # fmt: skip
    others = [cfg for cfg in llms if cfg != "plain"]
    for set_name, set_convs in convs.items():
        for c in concurrency:
            key = f"{set_name}_c{c}"
            plains = [timed_run(llms["plain"], set_convs, c, new_tokens, args.device, mb)]
            tries: dict[str, list[dict]] = {cfg: [] for cfg in others}
            for r in range(args.rounds):
                for cfg in others[r % len(others) :] + others[: r % len(others)]:
                    row = timed_run(llms[cfg], set_convs, c, new_tokens, args.device, mb)
                    row["plain_around"] = [plains[-1]]  # and the plain run after: below
                    tries[cfg].append(row)
                plains.append(timed_run(llms["plain"], set_convs, c, new_tokens, args.device, mb))
                for cfg in others:
                    tries[cfg][-1]["plain_around"].append(plains[-1])
            plain_ids[key] = plains[0]["ids"]
            plain_tps = [p["tok_per_s"] for p in plains]
            first = {k: v for k, v in plains[0].items() if k != "ids"}
            first.update(
                tok_per_s=round(statistics.median(plain_tps), 2), tok_per_s_runs=plain_tps,
                speedup=1.0, same_output_fraction=1.0, median_first_divergence=None,
            )  # fmt: skip
            runs.setdefault(key, {})["plain"] = first
            for cfg, row in {"plain": first, **{n: summarize(t) for n, t in tries.items()}}.items():
                if cfg != "plain":
                    ids = row.pop("ids")
                    # bf16 batched verify may flip near-tie argmaxes; fp32 equality is what
                    # the tests assert, so this is a measure, not a check
                    row.update(identity_summary(ids, plain_ids[key]))
                    runs[key][cfg] = row
                acc, div = row["accept_length"], row["median_first_divergence"]
                print(f"{cfg:16s} {key:14s} {row['tok_per_s']:>9.1f} {row['speedup']:>8.2f} "
                      f"{'-' if acc is None else acc:>7} {row['same_output_fraction']:>6} "
                      f"{'-' if div is None else div:>6}", flush=True)  # fmt: skip
    idle: dict = {}
    for c in args.device_idle:
        for cfg, llm in llms.items():
            row = profiled_run(llm, next(iter(convs.values())), c, new_tokens)
            idle.setdefault(cfg, {})[str(c)] = row
            by_k = (row["step_split"] or {}).get("steps_by_k")
            print(f"{cfg:16s} idle c{c:<11d} {row['idle_fraction']:>9.1%} of "
                  f"{row['window_ms']:.0f} ms (launch {row['launch_gaps_fraction']:.1%}, "
                  f"host {row['host_gaps_fraction']:.1%}), steps by k {by_k}", flush=True)  # fmt: skip
    del llms
    gc.collect()
    result = {
        "device": args.device,
        "dtype": args.dtype,
        "model": args.model,
        "new_tokens": new_tokens,
        "concurrency": concurrency,
        "k": args.k,
        "tree": args.tree,
        "num_prompts": {s: len(v) for s, v in convs.items()},
        "rounds": args.rounds,
        "min_batches": mb,
        "configs": specs,
        "errors": errors,
        "runs": runs,
        "device_idle": idle,
        **summary_tables(runs),
    }
    path = write_result(name, result, args.out_dir)
    print(f"wrote {path}", flush=True)
    plot(result, list(convs), Path(args.plot) if args.plot else path.with_suffix(".png"))


if __name__ == "__main__":
    main()
