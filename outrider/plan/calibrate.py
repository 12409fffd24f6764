"""`outrider plan --calibrate`: the cost model's machine constants fitted to this machine's own
step times, written as a GPU profile that `outrider plan --gpu FILE` reads.

What is measured: the engine's step timings (executor/step_timing.py, the adaptive controller's
start-up profile): a plain decode step and the speculative verify step at each batch size and
k, on dummy rows in the scratch block, CUDA graphs where the engine captures them, the host read
included; on CUDA also each step's device time, its device work timed by events with the
host kept out of it (step_timing.device_ms). One rank (tp 1): collectives are `outrider bench
comm`'s.

What is fitted, and why these. The cost model prices a kernel at max(bytes / (bandwidth x
mem_efficiency), flops / (peak x compute_efficiency)) plus its overhead (gemm_overhead_us for
a GEMM, kernel_overhead_us for any other), an eager step at no less than launches x
eager_host_us (on the CPU at that much more), and every engine step at step_host_us more for
the host's own work. The peaks come from datasheets and stay: only a peak times its efficiency
reaches the prediction, so fitting both would be fitting one number twice. On the CPU the
BLAS's step in a GEMM's rows is measured directly (measure_gemm_rows), not fitted: a
calibration grid need not hold the 2- and 3-row GEMMs that show it. The constants fitted are
the ones no datasheet gives and the ones that decide small steps.

Why the device time. Within one model every step launches the same kernels, so a per-kernel
overhead and a per-step host cost move every point alike: fitted to step times alone, one
model's points cannot tell them apart, and the split they pick is what another model's
prediction depends on (a model of 400 kernels of 1 us and one of 400 kernels of 50 us share
the host's 0.3 ms, not the overheads' share of it). The measured device time pins the split:
the device constants are fitted to it, the host's to the rest. A constant the measured shapes
do not exercise (the host's per launch in graphed steps, compute where every kernel is
memory-bound) keeps its prior: a weak pull toward it decides a flat direction.

The fit: least squares on log(predicted / measured) over the points, step and device time each
(relative error, so a 40 ms step weighs as much as a 2 ms one), by coordinate descent in log
space, each constant a grid search within its bounds refined by golden section, a few sweeps,
then a Nelder-Mead simplex from there for the valleys along which constants trade off. With a
handful of points this finds a good local minimum rather than a certified global one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outrider.plan.costmodel import (
    Setup,
    StepCost,
    accept_kernels,
    forward_kernels,
    step_host,
    time_step,
)
from outrider.plan.hardware import LINKS, Gpu
from outrider.plan.models import ModelSpec

if TYPE_CHECKING:  # torch-heavy: build_runner imports it when a calibration runs
    from outrider.executor.model_runner import ModelRunner

# constant -> (lower bound, upper bound). Efficiencies may pass 1 where the base profile's
# peak is a guess (the CPU's) or caches serve what the model counts as memory reads.
FITTED: dict[str, tuple[float, float]] = {
    "mem_efficiency": (0.2, 1.0),
    "compute_efficiency": (0.05, 1.0),
    "gemm_overhead_us": (0.05, 500.0),
    "kernel_overhead_us": (0.05, 500.0),
    "step_host_us": (1.0, 1e6),
    "row_host_us": (1e-3, 1e4),
    "token_host_us": (1e-3, 1e3),
    "eager_host_us": (0.1, 2000.0),
}
PRIOR_WEIGHT = 0.05  # per constant, on log(value / prior)^2: see the module docstring
SWEEPS = 4


@dataclass(frozen=True)
class Point:
    """One measured step: `batch` sequences, k drafts each (0: plain decode); `device_ms`, the
    device's time in it where that was measured (None: the step's time alone)."""

    batch: int
    k: int
    measured_ms: float
    device_ms: float | None = None


def predict(model: ModelSpec, gpu: Gpu, point: Point, graphs: bool) -> StepCost:
    """The cost model's step for the one the engine measured: its rows hold 1 + k tokens in
    an empty cache (context 0), one rank. The same sums as costmodel.decode_cost and
    verify_cost, over kernel lists built once per shape (the fit prices them thousands of
    times)."""
    setup = Setup(model, gpu, LINKS["nvlink4"], tp=1, graphs=graphs, verify_graphs=graphs)
    kernels, collectives, experts = _kernels(model, point.batch, point.k)
    tokens = point.batch * (1 + point.k)
    kind = "verify" if point.k else "decode"
    step = time_step(kind, list(kernels), list(collectives), setup, graphs, tokens, experts)
    if point.k:
        step = step + time_step(kind, accept_kernels(point.batch, 1 + point.k), [], setup,
                                graphs, 0)  # fmt: skip
    return step + step_host(setup, kind, point.batch, tokens)


def predict_ms(model: ModelSpec, gpu: Gpu, point: Point, graphs: bool) -> float:
    return predict(model, gpu, point, graphs).ms


@functools.lru_cache(maxsize=64)
def _kernels(model: ModelSpec, batch: int, k: int) -> tuple[tuple, tuple, float]:
    ks, cs, experts = forward_kernels(model, 1, batch, 1 + k, 0)
    return tuple(ks), tuple(cs), experts


def _loss(
    model: ModelSpec, gpu: Gpu, prior: Gpu, points: list[Point], graphs: bool, pulled: tuple
) -> float:
    fit = 0.0
    for p in points:
        step = predict(model, gpu, p, graphs)
        fit += math.log(step.ms / p.measured_ms) ** 2
        if p.device_ms is not None:
            fit += math.log((step.ms - step.host_ms) / p.device_ms) ** 2
    pull = sum(math.log(getattr(gpu, f) / getattr(prior, f)) ** 2 for f in pulled)
    return fit / len(points) + PRIOR_WEIGHT * pull


def fit(model: ModelSpec, prior: Gpu, points: list[Point], graphs: bool) -> Gpu:
    """`prior` with FITTED's constants fitted to `points` (see the module's docstring)."""
    if not points:
        raise ValueError("calibration needs at least one measured step")
    bad = [p for p in points if not p.measured_ms > 0 or not (p.device_ms or 1) > 0]
    if bad:
        raise ValueError(f"measured times must be > 0 ms, got {bad}")
    # Constants pull toward a prior inside their bounds; one outside (a datasheet profile's
    # step_host_us is 0: its engine hides the host) is no prior, and only starts the search.
    pulled = tuple(f for f, (lo, hi) in FITTED.items() if lo <= getattr(prior, f) <= hi)
    prior = dataclasses.replace(
        prior, **{f: min(max(getattr(prior, f), lo), hi) for f, (lo, hi) in FITTED.items()}
    )
    fitted = dict(FITTED)
    if all(p.device_ms is not None for p in points):
        # The host's share is measured: step - device time, a plane in rows and tokens.
        host = _host_plane(points)
        for f in host:
            fitted.pop(f)
        prior = dataclasses.replace(prior, **host)
        pulled = tuple(f for f in pulled if f not in host)
    gpu = prior
    for _ in range(SWEEPS):
        for name, (lo, hi) in fitted.items():

            def f(x: float, name: str = name, gpu: Gpu = gpu) -> float:
                trial = dataclasses.replace(gpu, **{name: math.exp(x)})
                return _loss(model, trial, prior, points, graphs, pulled)

            x = _search(f, math.log(lo), math.log(hi), math.log(getattr(gpu, name)))
            gpu = dataclasses.replace(gpu, **{name: math.exp(x)})
    # Constants trade off along diagonal valleys (a lower bandwidth efficiency against a
    # higher floor) that one-at-a-time steps crawl along: a simplex walks them.
    names = list(fitted)
    bounds = [(math.log(lo), math.log(hi)) for lo, hi in fitted.values()]

    def at(xs: list[float]) -> Gpu:
        clamped = [min(max(x, lo), hi) for x, (lo, hi) in zip(xs, bounds)]
        return dataclasses.replace(gpu, **{n: math.exp(x) for n, x in zip(names, clamped)})

    xs = _nelder_mead(
        lambda xs: _loss(model, at(xs), prior, points, graphs, pulled),
        [math.log(getattr(gpu, n)) for n in names],
    )
    return at(xs)


def _host_plane(points: list[Point]) -> dict[str, float]:
    """step_host_us, row_host_us and token_host_us: a plane through step - device time (us)
    over the step's sequences and tokens, by medians of pairwise slopes (Theil-Sen), so a few
    outlying steps do not tilt it; each inside its bounds. A token's share from steps of one
    batch size and several k (same rows: only tokens differ), a row's from the rest across
    batch sizes, the step's from what remains. Why rows: both models' host times on the H200
    grew ~3.5 us a sequence and little with k, and the 8B's large verifies, where the device's
    own variation is the size of the host's share, made a line in tokens alone read ~0 for
    what the default model's steps pay (the fitted 8B then missed the default model's 64 x 16
    verify by 20-24%)."""
    ys = [(p.measured_ms - p.device_ms) * 1e3 for p in points]
    tokens = [p.batch * (1 + p.k) for p in points]
    pairs = [(i, j) for i in range(len(points)) for j in range(i + 1, len(points))]
    per_token = _median_slope(
        (tokens[j] - tokens[i], ys[j] - ys[i])
        for i, j in pairs
        if points[i].batch == points[j].batch
    )
    token = _clamp(per_token, FITTED["token_host_us"])
    rest = [y - token * n for y, n in zip(ys, tokens)]
    per_row = _median_slope(
        (points[j].batch - points[i].batch, rest[j] - rest[i]) for i, j in pairs
    )
    row = _clamp(per_row, FITTED["row_host_us"])
    step = sorted(r - row * p.batch for r, p in zip(rest, points))[len(points) // 2]
    return {
        "step_host_us": _clamp(step, FITTED["step_host_us"]),
        "row_host_us": row,
        "token_host_us": token,
    }


def _median_slope(runs_rises) -> float:
    """The median of rise / run over the pairs whose run is not 0 (0.0 if none)."""
    slopes = sorted(rise / run for run, rise in runs_rises if run)
    return slopes[len(slopes) // 2] if slopes else 0.0


def _clamp(x: float, bounds: tuple[float, float]) -> float:
    return min(max(x, bounds[0]), bounds[1])


def _nelder_mead(f, x0: list[float], step: float = 0.1, iters: int = 300) -> list[float]:
    """Nelder-Mead's simplex minimisation from x0 (standard coefficients)."""
    n = len(x0)
    simplex = [x0] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]

        def toward(t: float, centre=centre, worst=simplex[-1]) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        r = toward(-1.0)
        fr = f(r)
        if fr < values[0]:
            e = toward(-2.0)
            fe = f(e)
            simplex[-1], values[-1] = (e, fe) if fe < fr else (r, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = r, fr
        else:
            c = toward(0.5)
            fc = f(c)
            if fc < values[-1]:
                simplex[-1], values[-1] = c, fc
            else:  # shrink toward the best
                simplex = [simplex[0]] + [
                    [b + 0.5 * (x - b) for b, x in zip(simplex[0], p)] for p in simplex[1:]
                ]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def _search(f, a: float, b: float, start: float, grid: int = 16) -> float:
    """The minimiser of f on [a, b]: the best of a grid (a max() model has several valleys
    along one constant), refined by golden section between its neighbours; `start` is kept
    unless that beats it (a flat f leaves a constant where it was)."""
    xs = [a + (b - a) * i / (grid - 1) for i in range(grid)]
    i = min(range(grid), key=lambda j: f(xs[j]))
    x = _golden(f, xs[max(i - 1, 0)], xs[min(i + 1, grid - 1)])
    return x if f(x) < f(start) else start


def _golden(f, a: float, b: float, iters: int = 20) -> float:
    """The minimiser of a unimodal f on [a, b] by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return c if fc < fd else d


def mean_abs_error(model: ModelSpec, gpu: Gpu, points: list[Point], graphs: bool) -> float:
    """Mean |predicted / measured - 1| over the points."""
    errors = [abs(predict_ms(model, gpu, p, graphs) / p.measured_ms - 1) for p in points]
    return sum(errors) / len(errors)


def cpu_profile(threads: int, memory_gb: float, gemm_rows: tuple[int, float] = (0, 1.0)) -> Gpu:
    """A starting profile for the CPU, which has no datasheet row: ~20 GB/s of memory
    bandwidth and ~100 GFLOP/s fp32 a thread (AVX2's two FMA ports at ~3 GHz). The fit
    scales both through the efficiencies, which stop at 1: MKL's fp32 GEMM of 128 rows
    reaches ~120-140 GFLOP/s on 2 of this machine's cores, above the 100 that half of that peak
    allowed, and verifies of 16-20 tokens came out compute-bound where they are not.
    `gemm_rows`: measure_gemm_rows's."""
    rows, reads = gemm_rows
    return Gpu(f"cpu ({threads} threads)", 20.0, 0.1 * threads, 0.0, round(memory_gb, 1),
               gemv_rows=rows, gemm_weight_reads=reads)  # fmt: skip


# -- measuring: the engine's own step timings (imports torch) --------------------------------


@dataclass
class Measurement:
    model: ModelSpec
    points: list[Point]
    graphs: bool
    device: str
    dtype: str
    device_name: str
    threads: int
    memory_gb: float
    gemm_rows: tuple[int, float] = (0, 1.0)  # the CPU's (gemv_rows, gemm_weight_reads)


def measure(
    model_path: str | None,
    device: str,
    dtype: str,
    batch_sizes: tuple[int, ...],
    ks: tuple[int, ...],
    reps: int | None,
) -> Measurement:
    """Load the model into a ModelRunner as the engine would and time its decode and
    speculative steps (executor/step_timing.py) at every batch size and k (0: decode)."""
    from outrider.loaders.checkpoint import open_checkpoint

    return measure_checkpoint(open_checkpoint(model_path), device, dtype, batch_sizes, ks, reps)


def measure_checkpoint(
    checkpoint,  # loaders.checkpoint.Checkpoint: an opened model, or random weights of a shape
    device: str,
    dtype: str,
    batch_sizes: tuple[int, ...],
    ks: tuple[int, ...],
    reps: int | None,
    gpu_memory_utilization: float | None = None,
) -> Measurement:
    """`measure` for a checkpoint already open (benchmarks time random weights of a shape)."""
    from outrider.executor.step_timing import profile_steps

    runner = build_runner(checkpoint, device, dtype, ks, gpu_memory_utilization)
    spec_ks = tuple(sorted({k for k in ks if k > 0}))
    table, device_ms = profile_steps(runner, spec_ks, batch_sizes, reps, device_time=True)
    points = [
        Point(b, k, table[b][k], device_ms[b][k] if device_ms else None)
        for b in batch_sizes
        for k in sorted({0, *ks})
    ]
    m = measurement(runner, checkpoint, points)
    if runner.device.type == "cpu":
        m.gemm_rows = measure_gemm_rows(runner.dtype)
    return m


def measure_gemm_rows(dtype, hidden: int = 1024, out: int = 32768) -> tuple[int, float]:
    """The CPU's GEMM by rows (Gpu.gemv_rows, gemm_weight_reads): the least of 2..8 rows at
    which a [rows, hidden] x [hidden, out] product takes under 3/4 of that many one-row
    products (below it the BLAS runs one GEMV a row), and what it takes there and at twice
    the rows, the less, in one-row products (the packed path's extra passes over the weights).
    A property of the BLAS and the machine, so one weight of 128 MB in fp32, larger than the
    caches as a forward's weights are (a tiny model's would stay in them); the steps' own grid
    (B in {1, 4}, k in {0, 3}) has no 2- or 3-row GEMM to show it. (0, 1.0) where 2 rows
    already cost less: one read whatever the rows."""
    import torch

    w = torch.randn(out, hidden, dtype=dtype)

    def ms(rows: int) -> float:
        x = torch.randn(rows, hidden, dtype=dtype)
        times = []
        for _ in range(6):  # median of 5 after a warm-up: 2 shared cores vary +-20%
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t0)
        return sorted(times[1:])[2]

    with torch.inference_mode():
        one = ms(1)
        rows = next((r for r in range(2, 9) if ms(r) < 0.75 * r * one), 0)
        if rows <= 2:
            return 0, 1.0
        reads = min(ms(rows), ms(2 * rows)) / one
    return rows, max(1.0, reads)


def build_runner(
    checkpoint, device: str, dtype: str, ks: tuple[int, ...],
    gpu_memory_utilization: float | None = None,
):  # fmt: skip
    """A ModelRunner as the engine builds it, graphs captured, ready to time decode and the
    speculative step at every k in `ks` (0: decode only)."""
    from outrider.config import EngineConfig
    from outrider.executor.model_runner import ModelRunner

    spec_ks = tuple(sorted({k for k in ks if k > 0}))
    settings = {
        "model": {"model": str(checkpoint.path), "device": device, "dtype": dtype},
        "speculative": {"method": "ngram", "num_draft_tokens": max(spec_ks, default=1)},
    }
    if gpu_memory_utilization is not None:
        settings["cache"] = {"gpu_memory_utilization": gpu_memory_utilization}
    runner = ModelRunner(EngineConfig.from_dict(settings), checkpoint)
    runner.set_speculation(None, spec_ks or (1,))
    runner.capture_graphs()
    return runner


def measurement(runner: ModelRunner, checkpoint, points: list[Point]) -> Measurement:
    """The measured points of `runner` (build_runner's, over `checkpoint`) with what the cost
    model needs to price them: the model's shape in the dtypes it ran, the device."""
    import torch

    from outrider.plan.models import from_hf_dict

    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[runner.dtype]
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    spec = from_hf_dict(checkpoint.hf_config, name=checkpoint.path.name)
    # Weights run in the engine's dtype (GGUF and FP8 blocks are dequantized as they load),
    # except INT4 experts, which stay packed (layers/moe.py Int4FusedExperts).
    experts = spec.expert_weights if (spec.expert_weights or "").startswith("int4") else None
    model = dataclasses.replace(spec, weights=name, expert_weights=experts, kv_bytes=elem)
    cuda = runner.device.type == "cuda"
    memory_gb = (
        torch.cuda.get_device_properties(runner.device).total_memory / 1e9
        if cuda
        else _host_memory_gb()
    )
    return Measurement(
        model=model, points=points, graphs=runner.graphs is not None,
        device=str(runner.device), dtype=name,
        device_name=torch.cuda.get_device_name(runner.device) if cuda else "cpu",
        threads=torch.get_num_threads(), memory_gb=memory_gb,
    )  # fmt: skip


def _host_memory_gb() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def profile_json(m: Measurement, prior: Gpu, fitted: Gpu) -> dict:
    """The fitted profile: Gpu's fields (what `--gpu FILE` reads) and, under `calibration`,
    what it was fitted to."""

    def row(p: Point) -> dict:
        after = predict(m.model, fitted, p, m.graphs)
        return {"batch": p.batch, "k": p.k, "measured_ms": round(p.measured_ms, 4),
                "device_ms": None if p.device_ms is None else round(p.device_ms, 4),
                "predicted_before_ms": round(predict_ms(m.model, prior, p, m.graphs), 4),
                "predicted_after_ms": round(after.ms, 4),
                "predicted_device_ms": round(after.ms - after.host_ms, 4)}  # fmt: skip

    rows = [row(p) for p in m.points]
    return {
        **dataclasses.asdict(fitted),
        "calibration": {
            "model": m.model.name,
            "device": m.device,
            "device_name": m.device_name,
            "dtype": m.dtype,
            "cuda_graphs": m.graphs,
            "base_profile": prior.name,
            "fitted": list(FITTED),
            "points": rows,
            "mean_abs_error_before": round(mean_abs_error(m.model, prior, m.points, m.graphs), 4),
            "mean_abs_error_after": round(mean_abs_error(m.model, fitted, m.points, m.graphs), 4),
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        },
    }


def report(m: Measurement, prior: Gpu, fitted: Gpu) -> str:
    """Predicted against measured, before and after the fit, and the constants."""
    lines = [
        f"{m.model.name} on {m.device_name} ({m.device}, {m.dtype}, "
        f"{'CUDA graphs' if m.graphs else 'eager'}), base profile {prior.name}",
        f"{'batch':>5} {'k':>3} {'measured ms':>12} {'before ms':>10} {'err':>7} "
        f"{'after ms':>10} {'err':>7}",
    ]
    for p in m.points:
        before = predict_ms(m.model, prior, p, m.graphs)
        after = predict_ms(m.model, fitted, p, m.graphs)
        lines.append(
            f"{p.batch:>5} {p.k:>3} {p.measured_ms:>12.3f} {before:>10.3f} "
            f"{before / p.measured_ms - 1:>+7.0%} {after:>10.3f} {after / p.measured_ms - 1:>+7.0%}"
        )
    lines.append(
        f"mean |error|: {mean_abs_error(m.model, prior, m.points, m.graphs):.1%} before, "
        f"{mean_abs_error(m.model, fitted, m.points, m.graphs):.1%} after"
    )
    for f in FITTED:
        lines.append(f"  {f:<20} {getattr(prior, f):>10.4g} -> {getattr(fitted, f):.4g}")
    if fitted.gemv_rows:
        lines.append(
            f"  measured: a GEMM below {fitted.gemv_rows} rows runs one GEMV a row; from "
            f"{fitted.gemv_rows} on its weights cost {fitted.gemm_weight_reads:.2f} one-row reads"
        )
    return "\n".join(lines)
