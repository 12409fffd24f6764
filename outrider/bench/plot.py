"""PNG charts from `outrider bench serve` results, several runs overlaid by their `label` (spec
against plain, outrider against another server):

    throughput.png    output tokens/s against concurrency
    tpot.png          time per output token (median solid, p90 dotted) against concurrency
    ttft.png          time to first token (median solid, p90 dotted) against concurrency
    per_user.png      per-user speed (1000 / median TPOT) against total output tokens/s: the
                      trade-off curve; each point is marked with its concurrency
    accept_length.png accept length against concurrency (only when a run reported one), each
                      point marked with the verify steps it averages; runs without one are
                      named in the legend, not left out unsaid

One run keeps one colour in every chart of a set. `vllm bench serve --save-result` files hold
one point each, at their top level: those sharing a label join one line, so a vLLM sweep run
point by point overlays an outrider sweep. A file with `runs` ({label: result}, as
benchmarks/spec_serve.py writes) gives one line per run.

matplotlib is imported inside `plot_results` (the object API, no pyplot and no global backend),
so the CLI's parser never pays for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outrider.bench.stats import accept_summary, spec_share

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
        runs = data.get("runs")
        if isinstance(runs, dict) and all(isinstance(r.get("points"), list) for r in runs.values()):
            series += [(name, run["points"]) for name, run in runs.items()]
        elif isinstance(data.get("points"), list):
            series.append((label, data["points"]))
        elif "output_throughput" in data:
            flat.setdefault(label, []).append(data)
        else:
            raise ValueError(
                f"{path} is not a benchmark result: expected `outrider bench serve`'s JSON "
                "(a 'points' list, or 'runs' of them) or `vllm bench serve --save-result`'s "
                "(output_throughput)"
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


def plot_results(
    series: list[Series],
    out_dir: str | Path,
    prefix: str = "",
    say: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write the charts for `series` to `out_dir`/<prefix><chart>.png; returns their paths.
    `say` gets one line per run about its accept length (what it rests on, or that it has none)
    when any run has one."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        from outrider.bench.serve import BenchError

        raise BenchError("plots need matplotlib: pip install matplotlib (or --no-plot)") from None

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = {label: f"C{i % 10}" for i, (label, _) in enumerate(series)}
    charts: list[tuple[str, Chart]] = [
        ("throughput", _throughput),
        ("tpot", _tpot),
        ("ttft", _ttft),
        ("per_user", _per_user),
        ("accept_length", _accept_length),
    ]
    written = []
    for name, draw in charts:
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        ax = fig.add_subplot()
        if not draw(ax, series, colors):
            continue  # nothing to show (accept length of runs without speculation)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        path = out / f"{prefix}{name}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
    if say is not None and _has_accept_length(series):
        for label, points in series:
            for p in points:
                say(f"[plot] {label} at concurrency {p.get('max_concurrency')}: accept length "
                    f"{accept_summary(p)}")  # fmt: skip
    return written


Colors = dict[str, str]  # label -> matplotlib colour, the same in every chart of a set
Chart = Callable[[Any, list[Series], Colors], bool]


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


def _by_concurrency(ax, series: list[Series], colors: Colors, key: str) -> bool:
    drew = False
    for label, points in series:
        xs, ys, _ = _xy(points, lambda p: p.get("max_concurrency"), lambda p: p.get(key))
        if xs:
            ax.plot(xs, ys, marker="o", label=label, color=colors[label])
            drew = True
    _concurrency_axis(ax, series)
    return drew


def _median_and_p90(ax, series: list[Series], colors: Colors, metric: str) -> bool:
    drew = False
    for label, points in series:
        for key, style in ((f"median_{metric}_ms", "-"), (f"p90_{metric}_ms", ":")):
            xs, ys, _ = _xy(points, lambda p: p.get("max_concurrency"), lambda p, k=key: p.get(k))
            if xs:
                name = label if style == "-" else None
                ax.plot(xs, ys, style, marker="o", color=colors[label], label=name)
                drew = True
    _concurrency_axis(ax, series)
    ax.set_ylim(bottom=0)  # from 0: a 5% difference drawn as a cliff misleads
    return drew


def _throughput(ax, series: list[Series], colors: Colors) -> bool:
    ax.set_title("Output throughput")
    ax.set_ylabel("output tokens/s (all requests)")
    drew = _by_concurrency(ax, series, colors, "output_throughput")
    ax.set_ylim(bottom=0)
    return drew


def _tpot(ax, series: list[Series], colors: Colors) -> bool:
    ax.set_title("Time per output token (median solid, p90 dotted)")
    ax.set_ylabel("TPOT (ms)")
    return _median_and_p90(ax, series, colors, "tpot")


def _ttft(ax, series: list[Series], colors: Colors) -> bool:
    ax.set_title("Time to first token (median solid, p90 dotted)")
    ax.set_ylabel("TTFT (ms)")
    return _median_and_p90(ax, series, colors, "ttft")


def _per_user(ax, series: list[Series], colors: Colors) -> bool:
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
            ax.plot(xs, ys, marker="o", label=label, color=colors[label])
            for x, y, p in zip(xs, ys, kept):
                ax.annotate(str(p.get("max_concurrency")), (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize="x-small")  # fmt: skip
            drew = True
    ax.margins(0.08)  # room for the concurrency marks at the edges
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    return drew


def _has_accept_length(series: list[Series]) -> bool:
    return any(_num(p.get("accept_length")) for _, points in series for p in points)


def _accept_length(ax, series: list[Series], colors: Colors) -> bool:
    """Each point labelled with the verify steps it averages (n=) and how much of the run
    speculated; runs without an accept length get a legend entry saying so."""
    if not _has_accept_length(series):
        return False
    ax.set_title("Accept length under load (tokens per verify step, from /metrics)")
    ax.set_ylabel("accept length (n = verify steps averaged)")
    top = 2.0
    last = max(
        (p["max_concurrency"] for _, pts in series for p in pts if _num(p.get("max_concurrency"))),
        default=None,
    )
    for label, points in series:
        xs, ys, kept = _xy(
            points, lambda p: p.get("max_concurrency"), lambda p: p.get("accept_length")
        )
        if not xs:
            ax.plot([], [], " ", label=f"{label}: no speculation (no accept length)")
            continue
        gone = [p["max_concurrency"] for p in points
                if p not in kept and _num(p.get("max_concurrency"))]  # fmt: skip
        missing = len(points) - len(kept)
        note = f" ({missing} point{'s' if missing > 1 else ''} without: x at 1)" if missing else ""
        ax.plot(xs, ys, marker="o", label=label + note, color=colors[label])
        if gone:  # where no draft was verified, on the floor, so the axis spans every point
            ax.plot(gone, [1] * len(gone), "x", color=colors[label], ms=8, clip_on=False)
        for x, y, p in zip(xs, ys, kept):
            # The rightmost point's note runs leftwards, or it crosses the frame.
            left = x == last
            ax.annotate(_point_note(p), (x, y), textcoords="offset points",
                        xytext=(-5 if left else 5, -12), ha="right" if left else "left",
                        fontsize="x-small", color=colors[label])  # fmt: skip
        top = max(top, *ys)
    _concurrency_axis(ax, series)
    ax.margins(x=0.1)
    ax.set_ylim(1, top + 0.15 * (top - 1) + 0.1)  # 1 is no speed-up: the floor of the scale
    return True


def _point_note(p: dict) -> str:
    """n=<verify steps>, and the share that speculated, for one accept-length point."""
    n = (p.get("spec_decode") or {}).get("num_drafts")
    share = spec_share(p)
    note = "" if n is None else f"n={n}"
    return note if share is None else f"{note}, {share[0]:.0%} of {share[1]}"
