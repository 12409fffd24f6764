"""Structured outputs as a user runs them (`outrider.LLM`): every case of
benchmarks/structured_schemas.json (JSON schemas, regexes, choices) asked as a one-turn chat,
without and with its constraint (SamplingParams.structured_outputs), by plain decoding, n-gram
and EAGLE-3 (chain of k and a tree; plain and the chains also without grammar drafts,
`_nogd`, constrained only: plain then takes a forced token a step), greedy and sampled, over a
concurrency sweep.

    python benchmarks/structured.py [--configs ngram eagle3 eagle3_tree plain_nogd ngram_nogd
        eagle3_nogd]
        [--concurrency 1 16 64]
        [--temperatures 0 0.8] [--max-tokens 200] [--num-schemas N] [--rounds 3] [--k 4]
        [--min-batches 3]
        [--cases PATH] [--model DIR] [--draft DIR] [--dtype auto] [--device cuda]
        [--grammar-masks] [--out NAME] [--out-dir DIR] [--plot PATH]

Every configuration is built first (plain always). Before any constrained request, the plain
engine times what a constraint costs before its first token: `EngineCore.validate`, which
compiles it (the first also builds the engine's llguidance view of the tokenizer), for fresh
constraints and a cached one, and a one-token request with a fresh constraint against the same
request without. Then each (temperature, C) slot runs plain unconstrained (the baseline) and
plain constrained once (untimed: the lengths of plain matched), then `--rounds` rounds of every other (configuration, constrained) pair in a rotated order, each
round followed by plain unconstrained again; a run's speedup is over the mean of the plain runs
around its round, the median over rounds is reported (as benchmarks/spec_gpu.py does, whose
helpers this imports). A run serves all cases in batches of C requests (cases cycled so every
batch holds C, and at least --min-batches batches: a run of one batch of 64 short answers
lasted 0.15-0.3 s on an H100, too short to time); a sampled request's seed is its case's index.

Per (configuration, constrained, temperature, C) it reports valid_fraction (outputs that parse
with json.loads and validate against their schema, fullmatch their regex or equal one of their
choices; unconstrained outputs are checked too, to show what the constraint buys),
valid_fraction_finished (among outputs that ended on their own rather than at max_tokens),
tok/s, speedup over plain unconstrained, vs_plain_matched (constrained tok/s over plain
unconstrained requests made exactly as long as plain constrained ones, "plain matched": the
grammar's cost for plain, speculation's gain under it otherwise; constrained outputs end
early, so their runs weigh prefill more than unconstrained ones), median_ttft_ms and
decode_tok_per_s_stream (each stream's rate after its first token) with decode_vs_plain (that
rate over plain's under the same constraint: what speculation changes), the step split (runner and
host milliseconds per step: masks are computed on the host), accept length, tokens per engine
step (prefills and steps that verified nothing included: what grammar drafts change) and every counter
of the engine's SpecStats over the run (num_forced_drafts: drafts the grammar forced), and at
temperature 0 the fraction of outputs identical to plain's under the same constraint.
Writes benchmarks/results/structured.json (CPU: structured_cpu.json) and a PNG of tok/s
against C, per configuration, constrained and not.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, save_figure, write_result  # noqa: E402
from spec_gpu import (  # noqa: E402
    _clock,
    _sync,
    batches,
    identity_summary,
    spec_configs,
    step_split,
    summarize,
)
from structured_cases import CASES, Case, load_cases  # noqa: E402

CONFIGS = ("plain", "ngram", "eagle3", "eagle3_tree", "plain_nogd", "ngram_nogd", "eagle3_nogd")
CONSTRAINTS = ("unconstrained", "constrained")
# Plain unconstrained requests made exactly as long as plain constrained ones (ignore_eos):
# constrained outputs end early, and a run of short outputs weighs its prefills more.
MATCHED = "matched"


def engine_configs(k: int, draft: str | None) -> dict[str, dict | None]:
    """Config name -> `speculative=` for LLM: spec_gpu's plain, ngram, eagle3_chain (fixed
    k, so accept lengths compare across constrained and not) and eagle3_tree (8 nodes, top 3,
    4 steps: the grammar prunes a tree to the paths it allows), and the two chains again
    without grammar drafts (`_nogd`: what the forced tokens add to the accept length), and
    plain without taking forced runs at once (plain_nogd: one forced token a step)."""
    specs = spec_configs(k, draft)
    ours = {"plain": specs["plain"], "ngram": specs["ngram"], "eagle3": specs["eagle3_chain"],
            "eagle3_tree": specs["eagle3_tree"]}  # fmt: skip
    nogd = {f"{n}_nogd": {**ours[n], "grammar_drafts": False} for n in ("ngram", "eagle3")}
    return ours | {"plain_nogd": {**(ours["plain"] or {}), "grammar_drafts": False}} | nogd


def request_params(
    case_index: int,
    case: Case,
    constrained: bool,
    temperature: float,
    max_tokens: int,
    length: int | None = None,
):
    """`length`: exactly this many tokens (ignore_eos), the length-matched baseline."""
    from outrider import SamplingParams

    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens if length is None else length,
        ignore_eos=length is not None,
        seed=case_index if temperature > 0 else None,
        structured_outputs=case.structured_outputs() if constrained else None,
    )


def validity(cases: list[Case], texts: list[str], finished: list[bool]) -> dict:
    """Counts over outputs (cases[i] asked, texts[i] answered; finished[i]: it ended on its own,
    not at max_tokens): valid, finished, valid among finished, and the invalid cases' names."""
    if not len(cases) == len(texts) == len(finished):
        raise ValueError(f"{len(cases)} cases, {len(texts)} outputs, {len(finished)} finish flags")
    ok = [c.is_valid(t) for c, t in zip(cases, texts)]
    return {
        "n": len(cases),
        "valid": sum(ok),
        "finished": sum(finished),
        "valid_finished": sum(v and f for v, f in zip(ok, finished)),
        "invalid": sorted({c.name for c, v in zip(cases, ok) if not v}),
    }


def validity_row(counts: list[dict]) -> dict:
    """Fractions over the counts of every round of one run."""
    n, valid, fin, vfin = (
        sum(c[k] for c in counts) for k in ("n", "valid", "finished", "valid_finished")
    )
    return {
        "valid_fraction": round(valid / n, 4) if n else None,
        "valid_fraction_finished": round(vfin / fin, 4) if fin else None,
        "finished_fraction": round(fin / n, 4) if n else None,
        "invalid": sorted({name for c in counts for name in c["invalid"]}),
    }


def first_token_split(outs: list) -> dict:
    """The run's time to first token and decode apart: the median TTFT (ms), and each stream's
    decode rate, sum(tokens after the first) / sum(time after the first token) over requests.
    Constrained outputs are short (tens of tokens), so a run's tok/s weighs its prefills;
    decode_tok_per_s_stream is what speculation changes."""
    ttft = [o.metrics.get("time_to_first_token_s") for o in outs]
    ttft = [t for t in ttft if t is not None]
    after = [(len(o.token_ids) - 1, o.metrics.get("e2e_latency_s"), o.metrics.get(
        "time_to_first_token_s")) for o in outs]  # fmt: skip
    after = [(n, e - t) for n, e, t in after if n > 0 and e is not None and t is not None]
    seconds = sum(d for _, d in after)
    return {
        "median_ttft_ms": round(1e3 * statistics.median(ttft), 3) if ttft else None,
        "decode_tok_per_s_stream": round(sum(n for n, _ in after) / seconds, 2)
        if seconds > 0 else None,
    }  # fmt: skip


def spec_counters(stats) -> dict:
    """Every field of the engine's SpecStats (those the engine adds for grammars too) and its
    accept length."""
    out = dataclasses.asdict(stats)
    out["accept_length"] = None if stats.accept_length is None else round(stats.accept_length, 3)
    return out


def timed_run(
    llm,
    constrained: bool,
    cases: list[Case],
    temperature: float,
    c: int,
    max_tokens: int,
    device: str,
    lengths: list[int] | None = None,
    min_batches: int = 1,
) -> dict:
    """Every case once (cycled to full batches of c, at least min_batches of them); tok/s over
    the timed part, validity counts, the engine's speculation counters and step split over it.
    `lengths` (one per request, in run order): each request makes exactly that many tokens,
    unconstrained."""
    idx = [i for batch in batches(list(range(len(cases))), c, min_batches) for i in batch]
    if lengths is not None and len(lengths) != len(idx):
        raise ValueError(f"{len(lengths)} lengths for a run of {len(idx)} requests")
    params = [
        request_params(
            i,
            cases[i],
            constrained,
            temperature,
            max_tokens,
            None if lengths is None else lengths[n],
        )  # fmt: skip
        for n, i in enumerate(idx)
    ]
    engine = llm.engine
    engine.speculator.reset_stats()
    before = _clock(engine)
    grammar_before = dataclasses.replace(engine.grammars.counters)
    ahead_before = (
        engine.num_steps_run_ahead,
        engine.num_steps_run_ahead_dropped,
        engine.num_rows_run_ahead_redone,
    )
    _sync(device)
    outs, t0 = [], time.perf_counter()
    for start in range(0, len(idx), c):
        batch = idx[start : start + c]
        convs = [[{"role": "user", "content": cases[i].prompt}] for i in batch]
        outs += llm.chat(convs, params[start : start + c])
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    stats = spec_counters(engine.speculator.stats)
    split = step_split(before, _clock(engine))
    grammar = grammar_split(grammar_before, engine.grammars.counters, split)
    counts = validity(
        [cases[i] for i in idx],
        [o.text for o in outs],
        [str(o.finish_reason) == "stop" for o in outs],
    )
    return {
        "requests": len(outs),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 2),
        **first_token_split(outs),
        "spec_stats": stats,
        "accept_length": stats["accept_length"],
        # Tokens per engine step, prefills included: unlike the accept length (over verify
        # steps only) it counts the steps that verified nothing, so runs with and without
        # grammar drafts compare on it (forced runs are short but turn plain steps into
        # verifying ones).
        "tokens_per_step": round(tokens / split["steps"], 3) if split else None,
        "step_split": split,
        "grammar": grammar,
        # Async scheduling: steps run ahead; where a grammar refused the unmasked argmax a
        # greedy constrained row ran ahead on, the rows computed again, or (beside a
        # drafter's aux streams) the steps dropped.
        "run_ahead": {
            "steps": engine.num_steps_run_ahead - ahead_before[0],
            "dropped": engine.num_steps_run_ahead_dropped - ahead_before[1],
            "rows_redone": engine.num_rows_run_ahead_redone - ahead_before[2],
        },
        "validity_counts": counts,
        "ids": [o.token_ids for o in outs],
    }


def grammar_split(before, after, split: dict | None) -> dict:
    """The grammars' work over a run (engine/structured.py GrammarCounters): mask rows filled
    ahead of the forwards, rows picked from their top logits (forced_rows: of those, the
    first token of the bytes the grammar forces, with no mask), masks those picks still needed
    (late_forced: of those, masks that allowed one token, with no read of the logits), rows of
    steps run ahead whose masked argmax the device took (masked_ahead), and the host
    milliseconds a step spent picking (inside the runner's time for speculative
    steps, in the host's for plain ones)."""
    steps = split["steps"] if split else 0
    return {
        "mask_rows": after.mask_rows - before.mask_rows,
        "picked_rows": after.picked_rows - before.picked_rows,
        "forced_rows": after.forced_rows - before.forced_rows,
        "late_masks": after.late_masks - before.late_masks,
        "late_forced": after.late_forced - before.late_forced,
        "masked_ahead": after.masked_ahead - before.masked_ahead,
        "path_ms_per_step": round((after.path_s - before.path_s) / steps * 1e3, 3)
        if steps
        else None,
    }


def compile_cost(llm, cases: list[Case], fresh: int = 3, repeats: int = 3) -> dict:
    """What a constraint costs before its first token, on an engine that has served no
    constrained request: `EngineCore.validate` (which compiles and caches the constraint)
    timed for cases[0] (it also builds the tokenizer's llguidance view, once per engine), for
    `fresh` more cases never seen (their compilation) and again for one seen (the cache); and
    end to end, a one-token request with a constraint not yet seen minus the same request
    without (median of `repeats`)."""
    from outrider import SamplingParams

    def ids(case: Case) -> list[int]:
        return llm.encode_chat_text(
            llm.apply_chat_template([{"role": "user", "content": case.prompt}])
        )

    def validate_ms(case: Case) -> float:
        params = SamplingParams(structured_outputs=case.structured_outputs())
        t0 = time.perf_counter()
        llm.engine.validate(ids(case), params)
        return round((time.perf_counter() - t0) * 1e3, 3)

    def request_s(case: Case, constrained: bool) -> float:
        params = request_params(0, case, constrained, 0.0, 1)
        t0 = time.perf_counter()
        llm.chat([[{"role": "user", "content": case.prompt}]], params)
        return time.perf_counter() - t0

    first = validate_ms(cases[0])
    rows = [{"case": c.name, "kind": c.kind, "ms": validate_ms(c)} for c in cases[1 : 1 + fresh]]
    cached = validate_ms(cases[0])
    probe = cases[min(1 + fresh, len(cases) - 1)]  # not compiled yet when the set has more
    free = statistics.median(request_s(probe, False) for _ in range(repeats))
    request_ms = (request_s(probe, True) - free) * 1e3
    return {
        "first_validate_ms": first,
        "first_case": cases[0].name,
        "fresh_validate_ms": rows,
        "fresh_validate_median_ms": statistics.median(r["ms"] for r in rows) if rows else None,
        "cached_validate_ms": cached,
        "first_token_request": {
            "case": probe.name,
            "unconstrained_ms": round(free * 1e3, 3),
            "constrained_extra_ms": round(request_ms, 3),
        },
    }


def slot_rows(plains: list[dict], tries: dict, greedy: bool) -> dict:
    """One (temperature, C) slot's rows {config: {constraint: row}} from its plain unconstrained
    runs (the first, then one after every round) and `tries` {(config, constraint): [runs with
    plain_around]}: spec_gpu's summarize per pair (speedup over plain unconstrained), validity
    over every round, the constrained-over-unconstrained tok/s of each config, and at
    temperature 0 each output's identity with plain's under the same constraint."""
    first = {k: v for k, v in plains[0].items() if k not in ("ids", "validity_counts")}
    plain_tps = [p["tok_per_s"] for p in plains]
    first.update(
        tok_per_s=round(statistics.median(plain_tps), 2),
        tok_per_s_runs=plain_tps,
        speedup=1.0,
        **validity_row([p["validity_counts"] for p in plains]),
    )
    rows: dict = {"plain": {"unconstrained": first}}
    ids = {("plain", "unconstrained"): plains[0]["ids"]}
    for (cfg, constraint), runs in tries.items():
        row = summarize(runs)
        ids[(cfg, constraint)] = row.pop("ids")
        row.pop("validity_counts")
        row.update(validity_row([r["validity_counts"] for r in runs]))
        rows.setdefault(cfg, {})[constraint] = row
    for (cfg, constraint), own in ids.items():
        row = rows[cfg][constraint]
        plain = ids.get(("plain", constraint))
        if cfg != "plain" and greedy and plain is not None:
            # bf16 batched verify may flip near-tie argmaxes: a measure, not a check
            row.update(identity_summary(own, plain))
    matched = rows["plain"].get(MATCHED, {}).get("tok_per_s")
    for by_constraint in rows.values():
        if set(CONSTRAINTS) <= set(by_constraint):
            free, fixed = (by_constraint[k]["tok_per_s"] for k in CONSTRAINTS)
            by_constraint["constrained"]["vs_unconstrained"] = round(fixed / free, 3)
        if "constrained" in by_constraint and matched:
            # Over plain decoding of the same lengths unconstrained: what the grammar costs
            # (plain) or what speculation gains under it, with prefill weighing the same.
            row = by_constraint["constrained"]
            row["vs_plain_matched"] = round(row["tok_per_s"] / matched, 3)
    for by_constraint in rows.values():  # decode alone, over plain's under the same constraint
        for constraint, row in by_constraint.items():
            base = rows["plain"].get(constraint, {}).get("decode_tok_per_s_stream")
            if base and row.get("decode_tok_per_s_stream"):
                row["decode_vs_plain"] = round(row["decode_tok_per_s_stream"] / base, 3)
    return rows


def sweep(
    llms: dict,
    cases: list[Case],
    temperatures: list[float],
    concurrency: list[int],
    rounds: int,
    max_tokens: int,
    device: str,
    min_batches: int = 1,
) -> dict:
    """Every (temperature, C) slot: plain unconstrained, then `rounds` rounds of every other
    (config, constraint) pair in a rotated order, each round followed by plain unconstrained;
    returns {f"t{T}_c{C}": slot_rows(...)}."""
    # Plain unconstrained is the baseline run around every round; a _nogd engine differs from
    # its twin only on constrained requests.
    pairs = [
        (cfg, k)
        for cfg in llms
        for k in CONSTRAINTS
        if k == "constrained" or not (cfg == "plain" or cfg.endswith("_nogd"))
    ] + [("plain", MATCHED)]
    print(
        f"{'config':11s} {'constraint':13s} {'run':10s} {'tok/s':>9s} {'speedup':>8s} "
        f"{'valid':>6s} {'accept':>7s} {'same':>6s} {'vs_pm':>6s} {'dec_vs_p':>7s}",
        flush=True,
    )
    runs: dict = {}
    for temperature in temperatures:
        for c in concurrency:
            key = f"t{temperature:g}_c{c}"
            args = (cases, temperature, c, max_tokens, device)
            plains = [timed_run(llms["plain"], False, *args, min_batches=min_batches)]
            # The lengths plain constrained decoding gives (fixed: greedy, or seeded).
            fixed = timed_run(llms["plain"], True, *args, min_batches=min_batches)
            lengths = [len(ids) for ids in fixed["ids"]]
            tries: dict = {pair: [] for pair in pairs}
            for r in range(rounds):
                for cfg, constraint in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
                    length = lengths if constraint == MATCHED else None
                    constrained = constraint == "constrained"
                    row = timed_run(llms[cfg], constrained, *args, length, min_batches)
                    row["plain_around"] = [plains[-1]]  # and the plain run after: below
                    tries[(cfg, constraint)].append(row)
                plains.append(timed_run(llms["plain"], False, *args, min_batches=min_batches))
                for pair in pairs:
                    tries[pair][-1]["plain_around"].append(plains[-1])
            runs[key] = slot_rows(plains, tries, greedy=temperature == 0)
            for cfg, by_constraint in runs[key].items():
                for constraint, row in by_constraint.items():
                    acc, same = row["accept_length"], row.get("same_output_fraction")
                    print(
                        f"{cfg:11s} {constraint:13s} {key:10s} {row['tok_per_s']:>9.1f} "
                        f"{row['speedup']:>8.2f} {row['valid_fraction']:>6} "
                        f"{'-' if acc is None else acc:>7} {'-' if same is None else same:>6} "
                        f"{row.get('vs_plain_matched', '-'):>6} "
                        f"{row.get('decode_vs_plain', '-'):>7}",
                        flush=True,
                    )
    return runs


def summary_tables(runs: dict) -> dict:
    """From runs {f"t{T}_c{C}": {config: {constraint: row}}}: per metric, temperature, config
    and constraint, the value by C (C and T as strings: JSON keys)."""
    metrics = (
        "tok_per_s", "speedup", "valid_fraction", "accept_length", "tokens_per_step",
        "vs_plain_matched", "median_ttft_ms", "decode_tok_per_s_stream", "decode_vs_plain",
    )  # fmt: skip
    out: dict = {m: {} for m in metrics}
    for key, rows in runs.items():
        t, c = key.rsplit("_c", 1)
        for cfg, by_constraint in rows.items():
            for constraint, row in by_constraint.items():
                for m in metrics:
                    if row.get(m) is not None:
                        table = out[m].setdefault(t[1:], {}).setdefault(cfg, {})
                        table.setdefault(constraint, {})[c] = row[m]
    return out


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    by_t = summary["tok_per_s"]
    fig, axes = plt.subplots(1, len(by_t), figsize=(6 * len(by_t), 4.5), squeeze=False)
    for ax, (t, by_cfg) in zip(axes[0], sorted(by_t.items(), key=lambda kv: float(kv[0]))):
        ticks = set()
        for i, (cfg, by_constraint) in enumerate(by_cfg.items()):
            for constraint, by_c in by_constraint.items():
                cs = sorted(by_c, key=int)
                ticks |= {int(x) for x in cs}
                ax.plot(
                    [int(x) for x in cs],
                    [by_c[x] for x in cs],
                    marker="o",
                    color=f"C{i}",
                    linestyle={"constrained": "--", MATCHED: ":"}.get(constraint, "-"),
                    label=f"{cfg} {constraint}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(x) for x in sorted(ticks)])
        ax.set(title=f"temperature {t}", xlabel="concurrency (requests per batch)", ylabel="tok/s")
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
        help="configurations to run (plain always runs: the baseline)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="requests per batch (default GPU 1 16 64, CPU 1 4)",
    )
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        help="0 is greedy; e.g. --temperatures 0 0.8",
    )
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument(
        "--num-schemas",
        type=int,
        default=None,
        help="cap on the cases of each kind (schemas, regexes, choices)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per (temperature, C) (default GPU 3, CPU 1)",
    )
    ap.add_argument(
        "--min-batches",
        type=int,
        default=None,
        help="batches of C requests a run serves at least, the cases cycled (default GPU 3, CPU 1)",
    )
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--cases", default=str(CASES), help="the case set (JSON)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 drafter dir (default: the shipped one)")
    ap.add_argument("--model", default=None, help="target model (default: the embedded one)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="result name (default structured / _cpu)")
    ap.add_argument("--out-dir", default=None, help="directory for the JSON (e.g. $OUT)")
    ap.add_argument("--plot", default=None, help="PNG path (default: beside the JSON)")
    ap.add_argument(
        "--grammar-masks",
        action="store_true",
        help="decide greedy constrained rows by vocabulary masks, as sampled ones are, instead "
        "of from their top logits (Grammars.paths): what the picks save or cost, run beside",
    )
    args = ap.parse_args()

    from outrider import LLM, SamplingParams

    if args.grammar_masks:
        from outrider.engine.structured import Grammars

        attach = Grammars.attach_masks
        Grammars.attach_masks = lambda self, batch, pick=False: attach(self, batch)

    cuda = args.device.startswith("cuda")
    concurrency = args.concurrency or ([1, 16, 64] if cuda else [1, 4])
    rounds = args.rounds or (3 if cuda else 1)
    if rounds < 1:
        ap.error(f"--rounds {rounds}: use 1 or more")
    min_batches = args.min_batches or (3 if cuda else 1)
    if min_batches < 1:
        ap.error(f"--min-batches {min_batches}: use 1 or more")
    name = args.out or ("structured" if cuda else "structured_cpu")
    cases = load_cases(args.cases, args.num_schemas)
    all_specs = engine_configs(args.k, args.draft)
    specs = {n: all_specs[n] for n in dict.fromkeys(["plain", *args.configs])}
    # A fixed pool (4096 blocks of 16 tokens, 1.5 GiB for the default model) lets the three
    # engines share a GPU, as in spec_gpu.py.
    memory = {"num_blocks": 4096} if cuda else {}
    llms, errors = {}, {}
    for cfg, spec in specs.items():
        try:
            llm = LLM(args.model, dtype=args.dtype, device=args.device, speculative=spec, **memory)
        except Exception as e:  # record and go on: one drafter missing should not cost the sweep
            if cfg == "plain":
                raise
            errors[cfg] = f"{type(e).__name__}: {e}"
            print(f"{cfg:8s} failed to build: {errors[cfg]}", flush=True)
            continue
        warm = [
            [{"role": "user", "content": cases[i % len(cases)].prompt}]
            for i in range(max(concurrency))
        ]
        llm.chat(warm, SamplingParams(temperature=0, max_tokens=16))  # kernels, graphs, autotune
        llms[cfg] = llm
    compile_ms = compile_cost(llms["plain"], cases)
    print(
        f"validate: first constraint {compile_ms['first_validate_ms']} ms (the engine's grammar "
        f"setup with it), a fresh one {compile_ms['fresh_validate_median_ms']} ms, a cached one "
        f"{compile_ms['cached_validate_ms']} ms",
        flush=True,
    )
    for llm in llms.values():  # what an engine sets up on its first constrained request
        llm.chat(
            [[{"role": "user", "content": cases[-1].prompt}]],
            request_params(0, cases[-1], True, 0.0, 16),
        )
    runs = sweep(
        llms,
        cases,
        args.temperatures,
        concurrency,
        rounds,
        args.max_tokens,
        args.device,
        min_batches,
    )
    del llms
    gc.collect()
    result = {
        "device": args.device,
        "grammar_masks": args.grammar_masks,
        "dtype": args.dtype,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "concurrency": concurrency,
        "temperatures": args.temperatures,
        "k": args.k,
        "rounds": rounds,
        "min_batches": min_batches,
        "cases": {
            "file": Path(args.cases).name,
            "names": [c.name for c in cases],
            "by_kind": {k: sum(c.kind == k for c in cases) for k in ("json", "regex", "choice")},
        },
        "configs": specs,
        "errors": errors,
        "compile_cost": compile_ms,
        "runs": runs,
        **summary_tables(runs),
    }
    path = write_result(name, result, args.out_dir)
    print(f"wrote {path}", flush=True)
    plot(result, Path(args.plot) if args.plot else path.with_suffix(".png"))


if __name__ == "__main__":
    main()
