"""`outrider drafter datagen | train | eval | export | doctor`. Every flag's default comes from the
config dataclasses (train/config.py); `--help` shows them. Each subcommand's flags are added only
when it is chosen (cli.Commands): the training configs import torch, which `outrider --help` and
`outrider drafter --help` should not pay for."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from typing import Any

from outrider.config import DEVICES, DTYPES
from outrider.flags import Commands, add_cache_flags, add_command, field_type, given


def add_drafter_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `drafter` to the top-level commands: its subcommands are added when it is chosen
    (cli.add_command), and each one's flags when that one is."""
    return add_command(
        subparsers,
        "drafter",
        _add_drafter_commands,
        help="build EAGLE-3 drafters: generate data, train, evaluate, export",
        description="Train an EAGLE-3 drafter for the target outrider serves, on hidden states "
        "outrider itself computes. Typical: datagen -> train -> eval -> export.",
    )


def _add_drafter_commands(drafter: argparse.ArgumentParser) -> None:
    sub = drafter.add_subparsers(
        dest="drafter_command", metavar="SUBCOMMAND", required=True, action=Commands
    )
    add_command(
        sub,
        "datagen",
        _add_datagen_flags,
        help="write conversations whose answers the target generates (JSONL)",
        description="Prompts from the built-in seed set, composed requests (--composed), "
        "Magpie-style self-generated turns and an optional user file; the target answers each "
        "through outrider. Resumable: rerun the same command to continue.",
    )
    add_command(
        sub,
        "train",
        _add_train_flags,
        help="train a drafter (torchrun for several GPUs)",
        description="TTT training with online target features. Several GPUs: torchrun "
        "--nproc-per-node N -m outrider drafter train ...",
    )
    add_command(
        sub,
        "eval",
        _add_eval_flags,
        help="per-step accuracy and estimated accept length on held-out samples",
        description="Scores the drafter on the dataset's last --num-samples samples (train "
        "with --holdout N to keep them out). --serving N also runs N of them through real "
        "speculative decoding and reports the measured accept length.",
    )
    add_command(
        sub,
        "export",
        _add_export_flags,
        help="rewrite a drafter for SGLang or vLLM",
        description="Load a drafter (any supported layout), check it against the target, and "
        "save it in the layout the chosen engine reads (aux layer ids converted).",
    )
    add_command(
        sub,
        "doctor",
        _add_doctor_flags,
        help="check a drafter against a target before serving it",
        description="Hidden size, the aux layer-id convention (SGLang vs vLLM, one layer "
        "apart), the d2t/t2d vocabulary map against the target's tokenizer, and (--live N) "
        "the accept length it reaches on N prompts. Exits 1 when a check fails.",
    )


def _add_datagen_flags(gen: argparse.ArgumentParser) -> None:
    from outrider.train.config import DatagenConfig

    _add_config_flags(gen, DatagenConfig, _DATAGEN_HELP)
    _add_target_flags(gen)
    gen.add_argument(
        "--max-model-len", type=int, default=None,
        help="the target's context while it answers, in tokens (default: the checkpoint's)",
    )  # fmt: skip
    add_cache_flags(gen)


def _add_train_flags(tr: argparse.ArgumentParser) -> None:
    from outrider.train.config import TrainConfig

    _add_config_flags(tr, TrainConfig, _TRAIN_HELP, choices={"dtype": DTYPES})


def _add_eval_flags(ev: argparse.ArgumentParser) -> None:
    from outrider.train.config import EvalConfig

    _add_config_flags(ev, EvalConfig, _EVAL_HELP, choices={"dtype": DTYPES})
    ev.add_argument(
        "--serving", type=int, default=0,
        help="also decode this many held-out prompts speculatively and report the measured "
        "accept length (0: off)",
    )  # fmt: skip
    ev.add_argument(
        "--max-tokens", type=int, default=128, help="tokens generated per --serving prompt"
    )
    add_cache_flags(ev)


def _add_export_flags(ex: argparse.ArgumentParser) -> None:
    from outrider.models.eagle3_io import LAYOUTS

    ex.add_argument("drafter", help="drafter directory")
    ex.add_argument("out", help="output directory")
    ex.add_argument(
        "--format", choices=LAYOUTS, default="sglang",
        help="the engine whose file layout (and aux layer-id convention) the drafter is saved in",
    )  # fmt: skip
    ex.add_argument("--model", default=None, help=_TARGET_HELP)


def _add_doctor_flags(doc: argparse.ArgumentParser) -> None:
    from outrider.models.eagle3_io import LAYOUTS

    doc.add_argument("drafter", help="drafter directory")
    doc.add_argument("--model", default=None, help=_TARGET_HELP)
    doc.add_argument(
        "--layout", choices=LAYOUTS, default=None,
        help="the layout to read a drafter whose files do not record theirs (default: detected)",
    )  # fmt: skip
    doc.add_argument(
        "--min-overlap", type=float, default=0.9,
        help="fail when less than this fraction of the drafter's vocabulary maps onto the "
        "target's tokenizer (0..1)",
    )  # fmt: skip
    doc.add_argument(
        "--live", type=int, default=0,
        help="also decode this many prompts verifying 4 drafts every step and report the "
        "accept length (0: off)",
    )  # fmt: skip
    add_cache_flags(doc)


def _doctor(args: argparse.Namespace) -> int:
    from outrider.speculative.eagle3_doctor import diagnose

    factory = None
    if args.live:

        def factory():
            from outrider.llm import LLM

            # "fixed": every decode step verifies 4 drafts, so the accept length is the
            # drafter's. The adaptive controller speculates only where this machine's step
            # costs say it pays, and on a CPU at small batches it verified no draft at all.
            spec = {"method": "eagle3", "draft": args.drafter, "num_draft_tokens": 4,
                    "controller": "fixed"}  # fmt: skip
            return LLM(args.model, speculative=spec, **given(args, "cache"))

    report = diagnose(
        args.drafter, args.model, min_overlap=args.min_overlap, live_prompts=args.live,
        layout=args.layout, llm_factory=factory,
    )  # fmt: skip
    print(report)
    return 0 if report.ok else 1


def cmd_drafter(args: argparse.Namespace) -> int:
    try:
        return _COMMANDS[args.drafter_command](args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _datagen(args: argparse.Namespace) -> int:
    from outrider.llm import LLM
    from outrider.train.config import DatagenConfig
    from outrider.train.datagen import generate_dataset

    c = _config(DatagenConfig, args)
    llm = LLM(
        c.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        **given(args, "cache"),
    )  # fmt: skip
    path = generate_dataset(
        llm, c.out, num_samples=c.num_samples, max_new_tokens=c.max_new_tokens,
        seed_prompts=c.seed_prompts, composed=c.composed, self_generated=c.self_generated,
        user_file=c.user_file,
        batch_size=c.batch_size, temperature=c.temperature, seed=c.seed,
        shard=(c.shard, c.num_shards),
    )  # fmt: skip
    print(f"dataset: {path}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from outrider.train.config import TrainConfig
    from outrider.train.trainer import train

    result = train(_config(TrainConfig, args))
    if result.drafter is not None:
        acc = " ".join(f"{a:.3f}" for a in result.step_acc)
        print(f"drafter: {result.drafter} (step {result.step}; per-step accuracy {acc})")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from outrider.llm import LLM
    from outrider.models.eagle3_io import load_drafter
    from outrider.train.config import EvalConfig
    from outrider.train.dataset import read_samples
    from outrider.train.evaluate import (
        confidence_profile,
        evaluate_drafter,
        replay_chain,
        serving_accept_length,
    )

    c = _config(EvalConfig, args)
    cache = given(args, "cache")
    llm = LLM(c.model, dtype=c.dtype, device=c.device, **cache)
    runner = llm.engine.runner
    draft = load_drafter(c.drafter, runner.model_config, device=runner.device, dtype=runner.dtype)
    samples = read_samples(c.data, runner.model_config.vocab_size, chat=llm)[-c.num_samples :]
    res = evaluate_drafter(draft, llm, samples, ttt_steps=c.ttt_steps, max_len=c.max_len)
    replay = replay_chain(draft, llm, samples, k=c.chain, max_len=c.max_len)
    report: dict[str, Any] = {
        "samples": len(samples),
        "tokens": res.num_tokens,
        "step_acc": [round(a, 4) for a in res.step_acc],
        "estimated_accept_length": round(res.estimated_accept_length, 3),
        # What the engine's greedy chain of `chain` accepts on these answers (exact when they
        # are the target's own greedy answers, as datagen writes at temperature 0).
        f"replayed_chain{c.chain}_accept_length": round(replay.accept_length, 3),
    }
    # Where the first draft misses: by the target's own top-1 probability at the drafted token.
    prof = confidence_profile(draft, llm, samples, max_len=c.max_len)
    report["by_target_confidence"] = prof.report()
    if args.serving > 0:
        from outrider.core import SamplingParams

        del llm, draft
        spec = LLM(c.model, dtype=c.dtype, device=c.device,
                   speculative={"method": "eagle3", "draft": c.drafter}, **cache)  # fmt: skip
        prompts = [s.prompt() for s in samples[: args.serving]]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        report["serving_accept_length"] = round(serving_accept_length(spec, prompts, params), 3)
    print(json.dumps(report))
    return 0


def _export(args: argparse.Namespace) -> int:
    from outrider.loaders.checkpoint import open_checkpoint
    from outrider.models.eagle3_io import load_drafter, save_drafter

    target = open_checkpoint(args.model).config
    draft = load_drafter(args.drafter, target)
    print(f"drafter: {save_drafter(draft, args.out, args.format)} ({args.format} layout)")
    return 0


_COMMANDS = {
    "doctor": _doctor,
    "datagen": _datagen,
    "train": _train,
    "eval": _eval,
    "export": _export,
}


# -- flags from dataclasses -------------------------------------------------------------------


_TARGET_HELP = (
    "the target model: a .gguf file, an HF directory or repo id (default: the embedded model)"
)

# --help of each config field's flag: what it does and its unit.
_DATAGEN_HELP = {
    "out": "the JSONL file samples are appended to (rerunning resumes it)",
    "model": _TARGET_HELP,
    "num_samples": "samples to write in all, every source together",
    "max_new_tokens": "longest answer the target generates per turn, in tokens",
    "seed_prompts": "include the built-in seed prompts (--no-seed-prompts: leave them out)",
    "composed": "requests composed from templates and topic lists to add (0: none)",
    "self_generated": "Magpie-style samples whose user turns the target writes itself (0: none)",
    "user_file": "a JSON or JSONL file of prompts or conversations (ShareGPT, role/content "
    "lists, strings); the target regenerates every answer",
    "batch_size": "conversations the target answers together in one batch",
    "temperature": "the target's sampling temperature for answers (0: greedy, which `drafter "
    "eval` replays exactly)",
    "seed": "seeds the composed prompts and sampling, for a reproducible dataset",
    "shard": "with --num-shards N: this process writes every N-th sample starting here (0..N-1)",
    "num_shards": "processes sharing the work, each run with its own --shard",
}
_TRAIN_HELP = {
    "data": "the JSONL dataset `drafter datagen` wrote",
    "output_dir": "where checkpoints and the final drafter (OUTPUT_DIR/drafter) are written",
    "model": _TARGET_HELP,
    "device": "where the target and the drafter run: auto, cpu, cuda or cuda:N",
    "dtype": "the target's compute dtype (the drafter keeps fp32 master weights)",
    "draft_vocab_size": "tokens in the drafter's own vocabulary, the dataset's most frequent "
    "(default: min(32000, the target's vocabulary))",
    "ttt_steps": "draft steps unrolled per position in training (test-time training), 1..16",
    "step_decay": "loss weight ratio between successive draft steps: step j counts "
    "step_decay**j, in (0, 1]",
    "align_topk": "step j learns only where earlier steps had the target's argmax in their top "
    "k (0: off; 1 for chains, the serving topk for trees)",
    "hard_label": "weight of the cross-entropy on the target's argmax beside the soft "
    "distribution's, in [0, 1]",
    "intermediate_size": "the drafter's MLP width (default: the target's)",
    "aux_layers": "the 3 target layers whose entering residual streams the drafter fuses "
    "(default: EAGLE-3's 2, L//2, L-3)",
    "max_len": "tokens per packed training row; longer samples are truncated",
    "batch_rows": "packed rows per micro-batch",
    "grad_accum": "micro-batches accumulated per optimizer step",
    "holdout": "keep the dataset's last N samples out of training, for `drafter eval`",
    "epochs": "passes over the dataset (unless --max-steps or --max-minutes stop sooner)",
    "max_steps": "stop after this many optimizer steps (default: --epochs decide)",
    "max_minutes": "wall-clock budget in minutes for this output dir (resumes continue its "
    "clock; the LR schedule follows it)",
    "lr": "peak learning rate (AdamW), reached after warm-up",
    "warmup_ratio": "fraction of training spent warming the LR up linearly, in [0, 1)",
    "min_lr_ratio": "the cosine schedule ends at this fraction of --lr, in [0, 1]",
    "weight_decay": "AdamW's decoupled weight decay (0: none)",
    "max_grad_norm": "clip the gradient to this global L2 norm",
    "init_std": "standard deviation of the drafter's initial weights",
    "head_from_target": "start lm_head (draft-vocabulary rows) and the final norm from the "
    "target's own",
    "seed": "seeds initialisation and data order, for a reproducible run",
    "checkpoint_every": "save a checkpoint every N optimizer steps (and at the end)",
    "keep_checkpoints": "newest checkpoints kept in the output dir; older ones are deleted",
    "resume": "continue from the output dir's newest checkpoint",
    "init_from": "a drafter directory to fine-tune; its weights and draft vocabulary are kept",
    "attention": "the drafter's training attention: flex skips masked blocks (CUDA); sdpa is "
    "torch's fused kernel, keeping no scores for the backward; dense keeps (j+1) T x T scores "
    "at step j until the backward; auto: flex on CUDA, sdpa elsewhere",
    "feature_cache": "a directory to store the target's captured features in and reuse on "
    "later epochs and runs (bf16 shards; default: recompute them)",
    "layout": "the file layout of the final drafter: the engine that will load it",
    "log_every": "print loss and per-step accuracy every N optimizer steps",
    "target_num_blocks": "KV blocks of the target engine's own pool, which serves no request "
    "here (feature capture uses a private pool sized to each batch)",
}
_EVAL_HELP = {
    "drafter": "the drafter directory to score",
    "data": "the JSONL dataset; its last --num-samples samples are scored",
    "model": _TARGET_HELP,
    "device": "where the target and the drafter run: auto, cpu, cuda or cuda:N",
    "dtype": "the target's compute dtype; auto: bfloat16 on CUDA, float32 on CPU",
    "num_samples": "held-out samples scored: the dataset's last ones (train with --holdout)",
    "ttt_steps": "draft steps scored per position, 1..16",
    "max_len": "tokens per sample scored; longer ones are truncated",
    "chain": "length of the greedy draft chain replayed offline, 1..16 (exact on greedy "
    "datagen samples)",
}


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="auto", help=f"where the target runs: {', '.join(DEVICES)} or cuda:N"
    )
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES,
        help="the target's compute dtype; auto: bfloat16 on CUDA, float32 on CPU",
    )  # fmt: skip


def _add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    helps: dict[str, str],
    choices: dict[str, Any] | None = None,
) -> None:
    """One --flag per dataclass field, typed from its annotation, defaulting to its default
    (cli.HelpFormatter shows it), its help from `helps` (every field has one)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = field_type(hints[f.name])
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=helps[f.name]
            )
            continue
        extra = {"choices": choices[f.name]} if choices and choices.get(f.name) else {}
        if typing.get_origin(kind) is tuple:  # tuple[int, ...]: --flag 2 15 27
            kind, extra["nargs"] = typing.get_args(kind)[0], "+"
        parser.add_argument(flag, type=kind, default=f.default, help=helps[f.name], **extra)


def _config(cls: type, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
