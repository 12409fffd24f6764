"""How well `outrider plan` predicts this GPU's step times, calibrated on one model and checked
on another.

    python benchmarks/plan_accuracy.py [--ks 0 1 3 7 15] [--batches 1 16 64] [--reps 10]

Measures the engine's decode (k = 0) and speculative verify step times at every batch size and
k, and each step's device time (executor/step_timing.py through plan/calibrate.py: CUDA graphs,
the host read included, dummy rows at short contexts; the device's share timed by events), for
the embedded default model's shape and the Llama-3.1-8B shape (random bf16 weights; time does
not depend on them), both in this process and in turns (`measure_interleaved`). The planner's
machine constants are fitted to each model's points (what `outrider plan --calibrate` does) and
each fitted profile predicts both models. Per point: measured ms; predicted by the datasheet
profile (`datasheet`), by the profile fitted on the same model (`self`), and by the one fitted on
the other model (`cross`), each with its error. Goal: |cross error| <= 20% at every point.

Writes benchmarks/results/plan_accuracy.json (--out: another path).

    python benchmarks/plan_accuracy.py --from benchmarks/results/plan_accuracy.json [--out F]

re-fits and re-predicts a earlier run's measured points with the cost model as it is now (the
built-in shapes of both models; no GPU needed), so a change to the model can be checked against
real measurements on any machine. Printed; written only with --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from gpu_decode import LLAMA_8B, SMOLLM2_135M, random_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 7, 15])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="result path (default: results/plan_accuracy.json)")
    ap.add_argument("--from", dest="source", default=None, help="an earlier result to re-fit")
    ap.add_argument(
        "--profiles-dir", default=None,
        help="also write each model's fitted profile here (what `outrider plan --gpu` reads)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.source:
        return refit(Path(args.source), args.out)
    if not torch.cuda.is_available():
        raise SystemExit("plan_accuracy measures a GPU: run it where CUDA is available")

    from outrider.plan import calibrate
    from outrider.plan.cli import _gpu_by_name

    measured = measure_interleaved(tuple(args.batches), tuple(sorted(set(args.ks))), args.reps)
    prior = _gpu_by_name(torch.cuda.get_device_name())
    graphs = {m.graphs for m in measured.values()}
    if len(graphs) != 1:
        raise SystemExit(f"one model replayed CUDA graphs and the other did not: {measured}")
    models = {name: m.model for name, m in measured.items()}
    points = {name: m.points for name, m in measured.items()}
    result = compare(models, points, prior, graphs.pop())
    path = write_result("plan_accuracy", result, args.out)
    print(f"worst cross error {result['worst_cross_error']:.1%}; wrote {path}")
    if args.profiles_dir:
        import json

        Path(args.profiles_dir).mkdir(parents=True, exist_ok=True)
        for name, m in measured.items():
            fitted = dataclasses.replace(prior, **result["fitted_on"][name])
            out = Path(args.profiles_dir) / f"plan_profile_{name}.json"
            out.write_text(json.dumps(calibrate.profile_json(m, prior, fitted), indent=1) + "\n")
            print(f"wrote {out}")
    return 0


SHAPES = {  # name -> (HF config, LM head tied to the embedding, gpu_memory_utilization)
    # Both runners live at once: the KV budget is that share of the device less what is in use.
    "smollm2-135m": (SMOLLM2_135M, True, 0.1),
    "llama-3.1-8b": (LLAMA_8B, False, 0.5),
}


ROUNDS = 3  # each point's step and device time: the median over rounds


def measure_interleaved(
    batches: tuple, ks: tuple, reps: int, shapes: dict | None = None, device: str = "cuda",
    dtype: str = "bfloat16", makers: dict | None = None,
) -> dict:  # fmt: skip
    """Both models' runners built in this process, then their points measured in turns: for
    each of ROUNDS rounds, each batch size, model after model. The host's share of a step
    drifts by 0.2-0.3 ms over minutes and between processes (the default model's 1.2-2.5 ms
    steps carry it whole), so each model measured in a block of its own saw a host of its own;
    in turns, both see the same one, which is what a profile carried from one model to the
    other assumes. Device times come from events (no profiler, whose tracing slowed every
    later launch in the process; none on the CPU). shapes: SHAPES' form, SHAPES by default;
    makers: name -> a function making that shape's checkpoint (default: gpu_decode's random
    Llama weights). -> {name: calibrate.Measurement}."""
    from outrider.executor.step_timing import profile_steps
    from outrider.plan import calibrate

    spec_ks = tuple(k for k in ks if k > 0)
    runners, checkpoints = {}, {}
    shapes = shapes or SHAPES
    for name, (hf, tied, memory) in shapes.items():
        make = (makers or {}).get(name)
        checkpoints[name] = (
            make() if make else random_checkpoint(hf, device, getattr(torch, dtype), tied_head=tied)
        )
        runners[name] = calibrate.build_runner(checkpoints[name], device, dtype, ks, memory)
    samples: dict = {name: {} for name in shapes}  # name -> (b, k) -> [(step, device or None)]
    for r in range(ROUNDS):
        for b in batches:
            for name, runner in runners.items():
                table, device_ms = profile_steps(runner, spec_ks, [b], reps, device_time=True)
                for k in table[b]:
                    dev = device_ms[b][k] if device_ms else None
                    samples[name].setdefault((b, k), []).append((table[b][k], dev))
        print(f"round {r + 1} of {ROUNDS} measured", flush=True)
    out = {}
    for name, runner in runners.items():
        points = []
        for (b, k), xs in sorted(samples[name].items()):
            step = sorted(x[0] for x in xs)[len(xs) // 2]
            devs = sorted(x[1] for x in xs if x[1] is not None)
            dev = devs[len(devs) // 2] if devs else None
            points.append(calibrate.Point(b, k, step, dev))
        m = calibrate.measurement(runner, checkpoints[name], points)
        out[name] = dataclasses.replace(m, model=dataclasses.replace(m.model, name=name))
    return out


def compare(models: dict, points: dict, prior, graphs: bool) -> dict:
    """Fit the machine constants to each model's points; predict every point with the
    datasheet profile, its own model's fit (`self`) and the other model's (`cross`)."""
    from outrider.plan import calibrate

    fitted = {name: calibrate.fit(models[name], prior, points[name], graphs) for name in models}
    names = list(models)
    rows, worst = [], 0.0
    for name in names:
        other = names[1 - names.index(name)]
        for p in points[name]:
            row = {
                "model": name,
                "batch": p.batch,
                "k": p.k,
                "measured_ms": round(p.measured_ms, 4),
                "device_ms": None if p.device_ms is None else round(p.device_ms, 4),
            }
            for label, gpu in (
                ("datasheet", prior),
                ("self", fitted[name]),
                ("cross", fitted[other]),
            ):
                ms = calibrate.predict_ms(models[name], gpu, p, graphs)
                row[f"{label}_ms"] = round(ms, 4)
                row[f"{label}_error"] = round(ms / p.measured_ms - 1, 4)
            worst = max(worst, abs(row["cross_error"]))
            rows.append(row)
            print(
                f"{name:13s} B={p.batch:3d} k={p.k:2d} measured {p.measured_ms:7.3f} ms  "
                f"datasheet {row['datasheet_error']:+6.1%}  self {row['self_error']:+6.1%}  "
                f"cross {row['cross_error']:+6.1%}",
                flush=True,
            )
    return {
        "gpu_profile": prior.name,
        "graphs": graphs,
        "fitted_on": {
            name: {f: round(getattr(gpu, f), 5) for f in calibrate.FITTED}
            for name, gpu in fitted.items()
        },
        "rows": rows,
        "worst_cross_error": round(worst, 4),
        "goal": "|cross_error| <= 0.20 at every point",
        "holds": worst <= 0.20,
    }


def refit(source: Path, out: str | None) -> int:
    """compare() over an earlier result's measured points, the models' built-in shapes in
    bf16 (what the measuring run built from their checkpoints)."""
    import json

    from outrider.plan import calibrate
    from outrider.plan.hardware import load_gpu
    from outrider.plan.models import load_model

    old = json.loads(source.read_text())
    points: dict = {}
    for row in old["rows"]:
        point = calibrate.Point(row["batch"], row["k"], row["measured_ms"], row.get("device_ms"))
        points.setdefault(row["model"], []).append(point)
    models = {
        name: dataclasses.replace(load_model(name), weights="bf16", expert_weights=None, kv_bytes=2)
        for name in points
    }
    # Runs before the field was written measured with graphs (the engine's default on CUDA).
    result = compare(models, points, load_gpu(old["gpu_profile"]), old.get("graphs", True))
    result["refit_of"] = {"path": str(source), "commit": old.get("commit")}
    print(f"worst cross error {result['worst_cross_error']:.1%}")
    if out:
        print(f"wrote {write_result('plan_accuracy', result, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
