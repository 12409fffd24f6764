"""What `bench serve` computes from what it saw: latency percentiles, the server's speculative
counters parsed from /metrics and their difference over a point, and the metadata every result
carries. Plain Python, no HTTP."""

from __future__ import annotations

import datetime
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)
# Speculative counters, as outrider and vLLM name them (same names, their own prefix).
SPEC_PREFIXES = ("outrider:", "vllm:")
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                totals[m[1]] = totals.get(m[1], 0.0) + float(m[3])
            except ValueError:
                continue
    return totals


_STEPS_SAMPLE = re.compile(r'^(?:outrider|vllm):spec_decode_steps_total\{.*\bk="(\d+)".*\}\s+(\S+)')
_AHEAD = "outrider:steps_run_ahead_total"


def spec_counters(text: str) -> dict[str, float] | None:
    """The speculative counters outrider or vLLM exposes (SPEC_COUNTERS); None without them.
    outrider's decode steps by drafts verified (spec_decode_steps_total{k}) add "plain_steps"
    (k = 0) and "spec_steps" (k > 0), where the server exports them."""
    samples = parse_prometheus(text)
    for prefix in SPEC_PREFIXES:
        names = [f"{prefix}spec_decode_{c}_total" for c in SPEC_COUNTERS]
        if all(n in samples for n in names):
            counters = {c: samples[n] for c, n in zip(SPEC_COUNTERS, names)}
            lines = map(_STEPS_SAMPLE.match, text.splitlines())
            steps = [(int(m[1]), float(m[2])) for m in lines if m]
            if steps:
                counters["plain_steps"] = sum(n for k, n in steps if k == 0)
                counters["spec_steps"] = sum(n for k, n in steps if k > 0)
            if _AHEAD in samples:
                counters["steps_run_ahead"] = samples[_AHEAD]
            return counters
    return None


def spec_delta(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """What a point added to the counters, and its accept length: tokens per verify step per
    sequence, the bonus token included (1 + accepted / drafts, as outrider and vLLM define it).
    None when the server has no counters or verified nothing, except where outrider's step
    counters show it decoded plainly throughout: then the zero counts and a step share of 0
    (accept length None), so a speculative server whose controller chose k = 0 reads as that,
    not as a server without speculation."""
    if before is None or after is None:
        return None
    d: dict[str, Any] = {c: int(after[c] - before[c]) for c in SPEC_COUNTERS}
    spec = plain = None
    if "spec_steps" in before and "spec_steps" in after:
        spec = int(after["spec_steps"] - before["spec_steps"])
        plain = int(after["plain_steps"] - before["plain_steps"])
    ahead = {}
    if "steps_run_ahead" in before and "steps_run_ahead" in after and (spec or 0) + (plain or 0):
        # Of the decode steps, those launched before the step before them was read.
        n = after["steps_run_ahead"] - before["steps_run_ahead"]
        ahead = {"run_ahead_share": min(1.0, n / (spec + plain))}
    if d["num_drafts"] <= 0:
        if not plain:
            return None
        return d | {"accept_length": None, "acceptance_rate": None, "spec_step_share": 0.0,
                    "decode_steps": plain, **ahead}  # fmt: skip
    d["accept_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"]
    d["acceptance_rate"] = (
        d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None
    )
    if spec is not None:
        d["spec_step_share"] = spec / (spec + plain) if spec + plain > 0 else None
        d["decode_steps"] = spec + plain
    return d | ahead


def spec_share(point: dict) -> tuple[float, str] | None:
    """How much of a point speculated: (share, "steps") from outrider's decode-step counters,
    else (share, "tokens"): output tokens verify steps produced (1 + accepted each). None
    without speculative counters."""
    spec = point.get("spec_decode") or {}
    if spec.get("spec_step_share") is not None:
        return spec["spec_step_share"], "steps"
    out = point.get("total_output_tokens")
    if spec.get("num_drafts") is None or not out:
        return None
    return min(1.0, (spec["num_drafts"] + spec.get("num_accepted_tokens", 0)) / out), "tokens"


def accept_summary(point: dict) -> str:
    """A point's accept length with what it rests on: the verify steps it averages and the
    share of the point that speculated. An average of 4 verify steps is no measurement, and
    2.3 over a tenth of the steps is not the speed-up 2.3 over all of them would be."""
    if point.get("accept_length") is None:
        steps = (point.get("spec_decode") or {}).get("decode_steps")
        if steps:  # a speculative server whose controller verified no drafts in this point
            return f"none: 0 of {steps} decode steps speculated (the server chose plain decoding)"
        return "none (no speculative decoding, or no counters on /metrics)"
    text = f"{point['accept_length']:.2f}"
    n = (point.get("spec_decode") or {}).get("num_drafts")
    if n is not None:
        text += f" over {n} verify step{'s' if n != 1 else ''}"
    share = spec_share(point)
    if share is not None:
        what = {"steps": "decode steps speculative", "tokens": "output tokens from verify steps"}
        what = what[share[1]]
        text += f", {share[0]:.0%} of {what}"
    return text


_LEDGER_SAMPLE = re.compile(
    r'^outrider:engine_step_(count|seconds|tokens|rows)_total\{.*\bkind="(\w+)".*\}\s+(\S+)'
)


def ledger_counters(text: str) -> dict[tuple[str, str], float]:
    """outrider's engine step ledger (engine/step_ledger.py) from /metrics: {(kind, series):
    value}, series "count", "seconds", "tokens" or "rows". Empty for a server without it."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _LEDGER_SAMPLE.match(line)
        if m:
            key = (m[2], m[1])
            out[key] = out.get(key, 0.0) + float(m[3])
    return out


def ledger_delta(before: dict, after: dict, duration: float) -> dict[str, Any] | None:
    """What a point's engine steps were, by kind: {kind: {"steps", "ms_per_step",
    "tokens_per_step", "rows_per_step", "time_share"}} with time_share the kind's seconds over
    the point's duration, and "busy_share" (every step's seconds over it: the rest the engine
    waited for work or did the server's part). None without a ledger or steps."""
    if not after or duration <= 0:
        return None
    out: dict[str, Any] = {}
    busy = 0.0
    for kind in dict.fromkeys(k for k, _ in after):
        d = {s: after.get((kind, s), 0.0) - before.get((kind, s), 0.0)
             for s in ("count", "seconds", "tokens", "rows")}  # fmt: skip
        if d["count"] <= 0:
            continue
        busy += d["seconds"]
        out[kind] = {
            "steps": int(d["count"]),
            "ms_per_step": round(d["seconds"] / d["count"] * 1e3, 3),
            "tokens_per_step": round(d["tokens"] / d["count"], 2),
            "rows_per_step": round(d["rows"] / d["count"], 2),
            "time_share": round(d["seconds"] / duration, 4),
        }
    if not out:
        return None
    return {"busy_share": round(busy / duration, 4), "kinds": out}


_TP_SAMPLE = re.compile(
    r"^(?:outrider|vllm):(collective_calls|collective_bytes|forwards)_total\{(.*)\}\s+(\S+)"
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def tp_counters(text: str) -> dict[tuple[str, str, str], float]:
    """outrider's tensor-parallel counters, summed over models: {(series, mode, op): value},
    series "collective_calls", "collective_bytes" or "forwards" (op "" there). Empty on one
    rank, and for a server that does not export them."""
    totals: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        m = _TP_SAMPLE.match(line)
        if m:
            labels = dict(_LABEL.findall(m[2]))
            key = (m[1], labels.get("mode", ""), labels.get("op", ""))
            totals[key] = totals.get(key, 0.0) + float(m[3])
    return totals


def tp_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, float]] | None:
    """What a point's forwards moved, per forward of each mode that ran: {mode: {"forwards",
    "all_reduce_per_forward", "all_gather_per_forward", "broadcast_per_forward",
    "bytes_per_forward"}} — the measured side of the planner's all-reduces per forward. None
    when the server counts no collectives (one rank) or ran no forward."""
    if not before and not after:
        return None
    before, after = before or {}, after or {}

    def d(key: tuple[str, str, str]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out: dict[str, dict[str, float]] = {}
    for mode in sorted({k[1] for k in after if k[0] == "forwards"}):
        n = d(("forwards", mode, ""))
        if n <= 0:
            continue
        row = {"forwards": int(n)}
        for op in ("all_reduce", "all_gather", "broadcast"):
            row[f"{op}_per_forward"] = d(("collective_calls", mode, op)) / n
        moved = sum(d(k) for k in after if k[0] == "collective_bytes" and k[1] == mode)
        row["bytes_per_forward"] = moved / n
        out[mode] = row
    return out or None


def percentile(sorted_values: list[float], p: float) -> float:
    """numpy's default (linear interpolation between closest ranks)."""
    k = (len(sorted_values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def latency_stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """mean/median/std/pN of `seconds`, in ms, under vLLM's key names (None when empty)."""
    v = sorted(s * 1000 for s in seconds)
    stats = {
        f"mean_{name}_ms": statistics.fmean(v) if v else None,
        f"median_{name}_ms": statistics.median(v) if v else None,
        f"std_{name}_ms": statistics.pstdev(v) if v else None,
    }
    stats.update({f"p{p}_{name}_ms": percentile(v, p) if v else None for p in PERCENTILES})
    return stats


def run_metadata() -> dict[str, Any]:
    """The command, date, commit, client machine and versions, as benchmarks/common.py records
    them (outrider/ does not import benchmarks/). The machine is the client's: the server's
    own is whatever base_url points at."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    commit, dirty = git_commit(Path(__file__).resolve().parents[2])
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": commit,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "versions": {
            "python": platform.python_version(),
            "outrider": installed("outrider"),
            "httpx": installed("httpx"),
        },
    }


def git_commit(repo: Path) -> tuple[str | None, bool | None]:
    """HEAD and whether tracked files differ from it; (None, None) outside a git checkout
    (an installed package)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo, timeout=10
        )
        if head.returncode != 0:
            return None, None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, cwd=repo, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())
