"""`outrider plan MODEL`: predicted decode, verify and draft time, break-even accept length and
the best k or tree per batch size, before anything is trained. Nothing here imports torch;
matplotlib is imported only to write --png."""

from __future__ import annotations

import argparse
import dataclasses
import json

from outrider.flags import add_command

DEFAULT_TREES = ("16,4,5",)
EMBEDDED_MODEL = "smollm2-135m"  # the planner's shape of the checkpoint embedded in outrider


def add_plan_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `plan` to the top-level commands."""
    return add_command(
        commands,
        "plan",
        _add_plan_flags,
        help="predict step times and where speculation pays, for any model, GPU and link",
        description="A cost model: the bytes, FLOPs, launches and collectives of decode, verify "
        "and draft steps, their predicted milliseconds (compute / memory / communication / "
        "launch), the accept length speculation needs to break even, and the best k or tree "
        "per batch size for an acceptance curve. docs/plan.md explains the model.",
    )


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    from outrider.plan.hardware import GPUS, LINKS
    from outrider.plan.models import BUILTIN, WEIGHT_FORMATS
    from outrider.plan.planner import METHODS

    p.add_argument(
        "model", nargs="?", default=None,
        help=f"a built-in name ({', '.join(BUILTIN)}), a config.json or a model directory; "
        "with --calibrate, a checkpoint the engine loads (default: the embedded default model)",
    )  # fmt: skip
    g = p.add_argument_group("machine")
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="GPUs the model is split over (tensor parallelism)",
    )
    g.add_argument(
        "--gpu", default=None,
        help=f"{', '.join(GPUS)}, or a JSON file of measured figures (`--calibrate` writes one) "
        "(default: h200; with --calibrate, this machine's GPU or a CPU profile)",
    )  # fmt: skip
    g.add_argument(
        "--link", default="nvlink4",
        help=f"{', '.join(LINKS)}, or a JSON file of measured collective times",
    )  # fmt: skip
    g.add_argument(
        "--nccl-channels", type=int, default=None, metavar="C",
        help="NCCL channels on a link without P2P (NCCL_MIN_NCHANNELS; default: NCCL's 2)",
    )  # fmt: skip
    g.add_argument(
        "--allreduce", choices=("ring", "ring-simple", "oneshot"), default=None,
        help="pin the all-reduce algorithm (default: the link's cheapest)",
    )  # fmt: skip
    g.add_argument("--eager", action="store_true", help="no CUDA graphs at all")
    g.add_argument(
        "--eager-verify", action="store_true",
        help="verify and draft steps run eager (an engine without verify graphs)",
    )  # fmt: skip
    g = p.add_argument_group("workload")
    g.add_argument(
        "--batch", type=int, nargs="+", default=[1, 8, 32], metavar="B",
        help="sequences decoding together (several: one plan each)",
    )  # fmt: skip
    g.add_argument("--context", type=int, default=2048, help="tokens in each sequence's KV")
    g.add_argument(
        "--routing", default=None, metavar="FILE",
        help="an MoE model's measured routing (`outrider bench routing` writes it): experts "
        "touched and grouped-GEMM blocks priced from it instead of uniform routing",
    )  # fmt: skip
    g.add_argument(
        "--weights", choices=tuple(WEIGHT_FORMATS), default=None,
        help="every linear layer's format (default: the model's own)",
    )  # fmt: skip
    g.add_argument(
        "--expert-weights", choices=tuple(WEIGHT_FORMATS), default=None,
        help="the routed experts' weight format (default: the model's own)",
    )  # fmt: skip
    g = p.add_argument_group("speculation")
    g.add_argument(
        "--spec", choices=METHODS, default="eagle3", help="the drafting method planned for"
    )
    g.add_argument("--k", type=int, default=3, help="the chain the headline figures describe")
    g.add_argument("--max-k", type=int, default=8, help="chains k = 1..MAX_K are compared")
    g.add_argument(
        "--tree", action="append", default=None, metavar="NODES,TOPK,STEPS",
        help=f"a draft tree to compare (repeatable; default: {' and '.join(DEFAULT_TREES)})",
    )  # fmt: skip
    g.add_argument(
        "--acceptance", type=float, nargs="+", default=[0.7], metavar="A",
        help="acceptance rate per draft position (the last repeats): 0.8 0.7 0.6",
    )  # fmt: skip
    g.add_argument("--draft-layers", type=int, default=1, help="the drafter's decoder layers")
    g.add_argument(
        "--draft-intermediate", type=int, default=None, metavar="SIZE",
        help="the drafter's MLP width (default: the target's)",
    )  # fmt: skip
    g.add_argument(
        "--draft-vocab", type=int, default=32000, help="tokens in the drafter's vocabulary"
    )
    g.add_argument(
        "--draft-tp", type=int, default=None, metavar="N",
        help="ranks the drafter runs on (default: --tp; 1: one rank alone)",
    )  # fmt: skip
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead")
    g.add_argument("--png", default=None, metavar="PATH", help="write the speedup chart here")
    g = p.add_argument_group(
        "calibration (measures this machine's steps through the engine; loads torch)"
    )
    g.add_argument(
        "--calibrate", action="store_true",
        help="time decode and verify steps of MODEL here, fit the cost model's efficiency and "
        "launch constants to them, and write a profile for --gpu",
    )  # fmt: skip
    g.add_argument(
        "--calibrate-out", default="calibrated-profile.json", metavar="PATH",
        help="where the fitted profile goes",
    )  # fmt: skip
    g.add_argument(
        "--calibrate-batch", type=int, nargs="+", default=[1, 4], metavar="B",
        help="batch sizes whose steps are measured",
    )  # fmt: skip
    g.add_argument(
        "--calibrate-k", type=int, nargs="+", default=[0, 3], metavar="K",
        help="drafts per sequence measured (0: plain decode)",
    )  # fmt: skip
    g.add_argument(
        "--calibrate-reps", type=int, default=None, metavar="N",
        help="timed steps per shape, median taken (default: the engine's: 10 with CUDA graphs, "
        "4 eager)",
    )  # fmt: skip
    g.add_argument("--device", default="auto", help="cuda, cpu or auto")
    g.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")


def cmd_plan(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    from outrider.env import default_model
    from outrider.plan.costmodel import Setup
    from outrider.plan.hardware import calibrated_dtype, load_gpu, load_link
    from outrider.plan.models import load_model, read_routing, weight_format
    from outrider.plan.planner import Drafter, Tree, drafter_model, plan_batch
    from outrider.plan.report import machine, table, to_json, write_png

    for name in ("k", "max_k", "context", "draft_layers", "draft_vocab"):
        if getattr(args, name) < (0 if name == "context" else 1):
            raise ValueError(f"invalid --{name.replace('_', '-')} {getattr(args, name)}")
    if any(b < 1 for b in args.batch):
        raise ValueError(f"invalid --batch {args.batch}: use sizes >= 1")
    # No MODEL: OUTRIDER_MODEL, else the embedded default's shape, as --help says.
    name = args.model or default_model() or EMBEDDED_MODEL
    model = load_model(name).with_weights(args.weights, args.expert_weights)
    if args.routing:
        model = model.with_routing(read_routing(args.routing), f"--routing {args.routing!r}")
    gpu = load_gpu(args.gpu or "h200")
    eager = args.eager
    if gpu.is_cpu:
        # The engine on a CPU captures no graphs and runs weights and KV in the dtype its
        # profile was calibrated in: a bf16 plan with graphs priced half the bytes the fit saw
        # and none of its dispatch.
        eager = True
        if args.weights is None:
            dtype = calibrated_dtype(args.gpu) or "fp32"
            kv = weight_format(dtype).bytes_per_element
            model = dataclasses.replace(model.with_weights(dtype), kv_bytes=max(1, round(kv)))
    link = load_link(args.link)
    if args.nccl_channels is not None:
        link = link.with_channels(args.nccl_channels)
    setup = Setup(
        model,
        gpu,
        link,
        tp=args.tp,
        graphs=not eager,
        verify_graphs=not (eager or args.eager_verify),
        algo=args.allreduce,
    )
    drafter = Drafter(
        args.spec, args.draft_layers, args.draft_intermediate, args.draft_vocab, args.draft_tp
    )
    if args.draft_tp is not None:
        drafter_model(model, drafter).check_tp(args.draft_tp)
    trees = tuple(Tree.parse(t) for t in (args.tree or DEFAULT_TREES))
    plans = [
        plan_batch(setup, drafter, b, args.context, args.acceptance, args.max_k, trees)
        for b in args.batch
    ]
    k = min(args.k, args.max_k)
    if args.json:
        print(json.dumps(to_json(setup, drafter, plans, k, args.context, args.acceptance)))
    else:
        print(table(setup, drafter, plans, k, args.context))
    if args.png:
        title = f"{model.name} on {machine(setup)}, context {args.context}, {drafter.method}"
        out = write_png(args.png, plans, title)
        if not args.json:
            print(f"\nchart: {out}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outrider.plan import calibrate
    from outrider.plan.hardware import load_gpu
    from outrider.plan.models import ALIASES, BUILTIN

    if args.tp != 1:
        raise ValueError(
            f"--calibrate measures one rank, not --tp {args.tp}: drop --tp (collectives are "
            "measured by `outrider bench comm`)"
        )
    if args.png or args.json:
        # Said before the measurement, not ignored after it: --calibrate prints no plan.
        flag = "--png" if args.png else "--json"
        raise ValueError(
            f"--calibrate writes a profile, not a plan, so {flag} has nothing to draw: run "
            f"`outrider plan MODEL --gpu {args.calibrate_out} {flag} ...` after it"
        )
    bad = [v for v in args.calibrate_batch if v < 1] + [v for v in args.calibrate_k if v < 0]
    if bad or (args.calibrate_reps is not None and args.calibrate_reps < 1):
        raise ValueError(
            f"invalid calibration shapes: --calibrate-batch {args.calibrate_batch} (>= 1), "
            f"--calibrate-k {args.calibrate_k} (>= 0), --calibrate-reps {args.calibrate_reps} "
            "(>= 1)"
        )
    model = args.model
    key = ALIASES.get((model or "").lower(), (model or "").lower())
    if key == EMBEDDED_MODEL:
        model = None  # the embedded default is that model
    elif key in BUILTIN:
        raise ValueError(
            f"--calibrate runs the model, and {args.model!r} is only a shape here: pass its "
            "checkpoint (a model directory or .gguf), or no MODEL for the embedded default"
        )
    m = calibrate.measure(
        model, args.device, args.dtype, tuple(args.calibrate_batch),
        tuple(sorted(set(args.calibrate_k))), args.calibrate_reps,
    )  # fmt: skip
    if args.gpu:
        prior = load_gpu(args.gpu)
        if m.gemm_rows[0]:
            rows, reads = m.gemm_rows
            prior = dataclasses.replace(prior, gemv_rows=rows, gemm_weight_reads=reads)
    elif m.device.startswith("cuda"):
        prior = _gpu_by_name(m.device_name)
    else:
        prior = calibrate.cpu_profile(m.threads, m.memory_gb, m.gemm_rows)
    fitted = calibrate.fit(m.model, prior, m.points, m.graphs)
    fitted = dataclasses.replace(fitted, name=f"{prior.name}, calibrated")
    print(calibrate.report(m, prior, fitted))
    out = Path(args.calibrate_out)
    out.write_text(json.dumps(calibrate.profile_json(m, prior, fitted), indent=1) + "\n")
    print(f"wrote {out}: use it as `outrider plan MODEL --gpu {out}`")
    return 0


def _gpu_by_name(device_name: str):
    """The built-in row whose name the CUDA device's name holds ("NVIDIA H200" -> h200)."""
    from outrider.plan.hardware import GPUS

    for gpu in sorted(GPUS.values(), key=lambda g: -len(g.name)):
        if gpu.name.lower() in device_name.lower():
            return gpu
    raise ValueError(
        f"no built-in figures for {device_name!r}: pass --gpu with the closest of "
        f"{', '.join(GPUS)} or a JSON file of its datasheet figures"
    )
