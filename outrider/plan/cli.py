"""`outrider plan MODEL`: predicted decode, verify and draft time, break-even accept length and
the best k or tree per batch size, before anything is trained. Nothing here imports torch;
matplotlib is imported only to write --png."""

from __future__ import annotations

import argparse
import json

from outrider.flags import add_command

DEFAULT_TREES = ("16,4,5",)


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
        "model",
        help=f"a built-in name ({', '.join(BUILTIN)}), a config.json or a model directory",
    )
    g = p.add_argument_group("machine")
    g.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size")
    g.add_argument(
        "--gpu", default="h200",
        help=f"{', '.join(GPUS)}, or a JSON file of measured figures",
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
        "--weights", choices=tuple(WEIGHT_FORMATS), default=None,
        help="every linear layer's format (default: the model's own)",
    )  # fmt: skip
    g.add_argument(
        "--expert-weights", choices=tuple(WEIGHT_FORMATS), default=None,
        help="routed experts' format (default: the model's own)",
    )  # fmt: skip
    g = p.add_argument_group("speculation")
    g.add_argument("--spec", choices=METHODS, default="eagle3", help="the drafting method")
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
    g.add_argument("--draft-vocab", type=int, default=32000, help="the drafter's vocabulary")
    g.add_argument(
        "--draft-tp", type=int, default=None, metavar="N",
        help="ranks the drafter runs on (default: --tp; 1: one rank alone)",
    )  # fmt: skip
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead")
    g.add_argument("--png", default=None, metavar="PATH", help="write the speedup chart here")


def cmd_plan(args: argparse.Namespace) -> int:
    from outrider.plan.costmodel import Setup
    from outrider.plan.hardware import load_gpu, load_link
    from outrider.plan.models import load_model
    from outrider.plan.planner import Drafter, Tree, drafter_model, plan_batch
    from outrider.plan.report import table, to_json, write_png

    for name in ("k", "max_k", "context", "draft_layers", "draft_vocab"):
        if getattr(args, name) < (0 if name == "context" else 1):
            raise ValueError(f"invalid --{name.replace('_', '-')} {getattr(args, name)}")
    if any(b < 1 for b in args.batch):
        raise ValueError(f"invalid --batch {args.batch}: use sizes >= 1")
    model = load_model(args.model).with_weights(args.weights, args.expert_weights)
    link = load_link(args.link)
    if args.nccl_channels is not None:
        link = link.with_channels(args.nccl_channels)
    setup = Setup(
        model,
        load_gpu(args.gpu),
        link,
        tp=args.tp,
        graphs=not args.eager,
        verify_graphs=not (args.eager or args.eager_verify),
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
        title = f"{model.name}, {args.tp} x {setup.gpu.name}, {link.name}"
        out = write_png(args.png, plans, title)
        if not args.json:
            print(f"\nchart: {out}")
    return 0
