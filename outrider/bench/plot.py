"""PNG charts from `outrider bench serve` results, several runs overlaid by their `label` (spec
against plain, outrider against another server):

    throughput.png    output tokens/s against concurrency
    tpot.png          time per output token (median solid, p90 dotted) against concurrency
    per_user.png      per-user speed (1000 / median TPOT) against total output tokens/s: the
                      trade-off curve; each point is marked with its concurrency
    accept_length.png accept length against concurrency (only when a run reported one)

`vllm bench serve --save-result` files hold one point each, at their top level: those sharing a
label join one line, so a vLLM sweep run point by point overlays an outrider sweep.

matplotlib is imported inside `plot_results` (the object API, no pyplot and no global backend),
so the CLI's parser never pays for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIGSIZE = (7.0, 4.5)  # inches; at DPI a PNG is 700 x 450 pixels
DPI = 100

Series = tuple[str, list[dict[str, Any]]]  # (label, points sorted by concurrency)


def load_results(paths: list[str | Path]) -> list[Series]:
    """One series per `bench serve` file; one-point files (vLLM's) sharing a label merged."""
    series: list[Series] = []
    flat: dict[str, list[dict]] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"no result file {str(path)!r}: give `bench serve` JSON files")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
        label = str(data.get("label") or data.get("model_id") or data.get("model") or path.stem)
        if isinstance(data.get("points"), list):
            series.append((label, data["points"]))
        elif "output_throughput" in data:
            flat.setdefault(label, []).append(data)
        else:
            raise ValueError(
                f"{path} is not a benchmark result: expected `outrider bench serve`'s JSON "
                "(a 'points' list) or `vllm bench serve --save-result`'s (output_throughput)"
            )
    series += flat.items()
    return [(label, sorted(pts, key=_concurrency)) for label, pts in _unique(series)]


def _unique(series: list[Series]) -> list[Series]:
    """Labels made distinct (a legend with two equal entries says nothing)."""
    seen: dict[str, int] = {}
    out = []
    for label, points in series:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label} ({seen[label]})", points))
    return out


def _concurrency(point: dict) -> float:
    c = point.get("max_concurrency")
    return float("inf") if c is None else c  # vLLM: None = unbounded


def plot_results(series: list[Series], out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Write the charts for `series` to `out_dir`/<prefix><chart>.png; returns their paths."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        from outrider.bench.serve import BenchError

        raise BenchError("plots need matplotlib: pip install matplotlib (or --no-plot)") from None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    charts: list[tuple[str, Callable[[Any, list[Series]], bool]]] = [
        ("throughput", _throughput),
        ("tpot", _tpot),
        ("per_user", _per_user),
        ("accept_length", _accept_length),
    ]
    written = []
    for name, draw in charts:
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        ax = fig.add_subplot()
        if not draw(ax, series):
            continue  # nothing to show (accept length of runs without speculation)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        path = out / f"{prefix}{name}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
    return written


def _xy(points: list[dict], x: Callable[[dict], Any], y: Callable[[dict], Any]):
    """(xs, ys, points) over the points where both are numbers (failed points hold None)."""
    kept = [p for p in points if _num(x(p)) and _num(y(p))]
    return [x(p) for p in kept], [y(p) for p in kept], kept


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and v == v and v not in (float("inf"), float("-inf"))


def _concurrency_axis(ax, series: list[Series]) -> None:
    """Concurrency on a log2 axis when it spans 4x or more, ticked at the values swept."""
    values = sorted({p["max_concurrency"] for _, pts in series for p in pts if _num(p.get("max_concurrency"))})  # fmt: skip
    if values and values[-1] >= 4 * values[0]:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    if values:
        ax.set_xticks(values, labels=[str(v) for v in values])
    ax.set_xlabel("max concurrency (requests in flight)")


def _by_concurrency(ax, series: list[Series], key: str, **style) -> bool:
    drew = False
    for label, points in series:
        xs, ys, _ = _xy(points, lambda p: p.get("max_concurrency"), lambda p: p.get(key))
        if xs:
            ax.plot(xs, ys, marker="o", label=label, **style)
            drew = True
    _concurrency_axis(ax, series)
    return drew


def _throughput(ax, series: list[Series]) -> bool:
    ax.set_title("Output throughput")
    ax.set_ylabel("output tokens/s (all requests)")
    drew = _by_concurrency(ax, series, "output_throughput")
    ax.set_ylim(bottom=0)
    return drew


def _tpot(ax, series: list[Series]) -> bool:
    ax.set_title("Time per output token (median solid, p90 dotted)")
    ax.set_ylabel("TPOT (ms)")
    drew = False
    for i, (label, points) in enumerate(series):
        color = f"C{i}"
        for key, style in (("median_tpot_ms", "-"), ("p90_tpot_ms", ":")):
            xs, ys, _ = _xy(points, lambda p: p.get("max_concurrency"), lambda p, k=key: p.get(k))
            if xs:
                name = label if style == "-" else None
                ax.plot(xs, ys, style, marker="o", color=color, label=name)
                drew = True
    _concurrency_axis(ax, series)
    ax.set_ylim(bottom=0)
    return drew


def _per_user(ax, series: list[Series]) -> bool:
    ax.set_title("Per-user speed against total throughput (points: concurrency)")
    ax.set_xlabel("output tokens/s (all requests)")
    ax.set_ylabel("tokens/s per user (1000 / median TPOT)")
    drew = False
    for label, points in series:
        xs, ys, kept = _xy(
            points,
            lambda p: p.get("output_throughput"),
            lambda p: 1000 / p["median_tpot_ms"] if p.get("median_tpot_ms") else None,
        )
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
            for x, y, p in zip(xs, ys, kept):
                ax.annotate(str(p.get("max_concurrency")), (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize="x-small")  # fmt: skip
            drew = True
    return drew


def _accept_length(ax, series: list[Series]) -> bool:
    ax.set_title("Accept length under load (tokens per verify step, from /metrics)")
    ax.set_ylabel("accept length")
    return _by_concurrency(ax, series, "accept_length")
