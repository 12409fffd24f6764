"""`outrider` command line. Flag defaults come from the config dataclasses and SamplingParams."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from outrider import env
from outrider.config import (
    SPEC_CONTROLLERS,
    SPEC_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
    defaults,
)

_SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
)


def build_parser() -> argparse.ArgumentParser:
    from outrider.core import SamplingParams

    parser = argparse.ArgumentParser(
        prog="outrider",
        description="LLM inference built around speculative decoding that pays off.",
        epilog="Run `outrider COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    gen = sub.add_parser(
        "generate",
        help="generate a completion for a prompt and stream it to stdout",
        description="Stream a completion to stdout (the model's chat template is applied unless "
        "--raw); throughput goes to stderr.",
    )
    gen.add_argument("prompt", nargs="+", help="the prompt (several words are joined with spaces)")
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    _add_engine_flags(gen)
    sp = defaults(SamplingParams)
    group = gen.add_argument_group("sampling")
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (the default here); > 0 samples"
    )
    group.add_argument("--top-p", type=float, default=sp["top_p"])
    group.add_argument("--top-k", type=int, default=sp["top_k"])
    group.add_argument("--min-p", type=float, default=sp["min_p"])
    group.add_argument("--presence-penalty", type=float, default=sp["presence_penalty"])
    group.add_argument("--frequency-penalty", type=float, default=sp["frequency_penalty"])
    group.add_argument("--repetition-penalty", type=float, default=sp["repetition_penalty"])
    group.add_argument("--seed", type=int, default=sp["seed"])
    group.add_argument("--max-tokens", type=int, default=sp["max_tokens"])
    group.add_argument("--min-tokens", type=int, default=sp["min_tokens"])
    group.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")

    from outrider.server.cli import add_deploy_parser, add_serve_parser
    from outrider.train.cli import add_drafter_parser

    add_serve_parser(sub)
    add_drafter_parser(sub)
    add_deploy_parser(sub)
    return parser


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    m, c, s = defaults(ModelConfig), defaults(CacheConfig), defaults(SchedulerConfig)
    group = p.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=m["model"],
        help="a .gguf file or an HF model directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument("--config", default=None, help="a YAML engine config; flags override it")
    group.add_argument(
        "--dtype", default=m["dtype"], choices=("auto", "float32", "bfloat16", "float16")
    )
    group.add_argument("--device", default=m["device"], help="auto, cpu, cuda or cuda:N")
    group.add_argument("--max-model-len", type=int, default=m["max_model_len"])
    group.add_argument("--block-size", type=int, default=c["block_size"])
    group.add_argument("--max-num-seqs", type=int, default=s["max_num_seqs"])
    sp = defaults(SpecConfig)
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--spec",
        default=sp["method"],
        choices=SPEC_METHODS,
        help="draft ahead of the model and verify in one forward (default: off)",
    )
    spec.add_argument(
        "--num-draft-tokens",
        type=int,
        default=sp["num_draft_tokens"],
        help="drafts verified per step (k)",
    )
    spec.add_argument(
        "--draft",
        default=sp["draft"],
        help="EAGLE-3: the drafter's directory (default: the one shipped for the default model)",
    )
    spec.add_argument(
        "--num-steps", type=int, default=sp["num_steps"], help="EAGLE-3 tree: draft steps"
    )
    spec.add_argument(
        "--topk", type=int, default=sp["topk"], help="EAGLE-3 tree: candidates per step (1: chain)"
    )
    spec.add_argument(
        "--spec-controller",
        default=sp["controller"],
        choices=SPEC_CONTROLLERS,
        help="adaptive: choose how many drafts to verify each step (0 where speculation would "
        "lose, from step times measured at start-up); fixed: always --num-draft-tokens",
    )
    group.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    base = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    m, c, s = defaults(ModelConfig), defaults(CacheConfig), defaults(SchedulerConfig)
    # A flag overrides the YAML only when it differs from the dataclass default.
    model = {
        k: getattr(args, k)
        for k in ("model", "dtype", "device", "max_model_len")
        if getattr(args, k) != m[k]
    }
    cache = {"block_size": args.block_size} if args.block_size != c["block_size"] else {}
    sched = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs != s["max_num_seqs"] else {}
    sp = defaults(SpecConfig)
    spec = {
        k: getattr(args, a)
        for k, a in (
            ("method", "spec"),
            ("num_draft_tokens", "num_draft_tokens"),
            ("draft", "draft"),
            ("num_steps", "num_steps"),
            ("topk", "topk"),
            ("controller", "spec_controller"),
        )
        if getattr(args, a) != sp[k]
    }
    return base.replace(model=model, cache=cache, scheduler=sched, speculative=spec)


def cmd_generate(args: argparse.Namespace) -> int:
    from outrider.core import SamplingParams
    from outrider.llm import LLM

    params = SamplingParams(**{k: getattr(args, k) for k in _SAMPLING_FLAGS}, stop=tuple(args.stop))
    t0 = time.perf_counter()
    llm = LLM(config=_engine_config(args))
    load_s = time.perf_counter() - t0
    prompt: str | list[int] = " ".join(args.prompt)
    if not args.raw:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        text = llm.apply_chat_template(messages + [{"role": "user", "content": prompt}])
        prompt = llm.encode_chat_text(text)
    metrics = {}
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        metrics = delta.metrics or metrics
    sys.stdout.write("\n")
    n = metrics.get("num_generated_tokens", 0)
    tps = metrics.get("decode_tokens_per_s") or metrics.get("tokens_per_s") or 0.0
    ttft = metrics.get("time_to_first_token_s") or 0.0
    if metrics.get("steps_by_k"):
        by_k = ", ".join(f"k={k}: {n}" for k, n in metrics["steps_by_k"].items())
        print(f"[outrider] decode steps by drafts verified ({by_k})", file=sys.stderr)
    if metrics.get("accept_length"):
        print(
            f"[outrider] speculative {args.spec}: accept length {metrics['accept_length']:.2f} "
            f"({metrics['num_accepted_tokens']}/{metrics['num_draft_tokens']} drafts accepted)",
            file=sys.stderr,
        )
    print(
        f"[outrider] {n} tokens, {tps:.1f} tok/s decode, first token {ttft * 1000:.0f} ms, "
        f"prompt {metrics.get('num_prompt_tokens', 0)} tokens, model load {load_s:.1f} s "
        f"({llm.engine.runner.device}, {str(llm.engine.runner.dtype).removeprefix('torch.')})",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.INFO if getattr(args, "verbose", False) else env.log_level()
    logging.basicConfig(level=level, format="[outrider] %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "drafter":
            from outrider.train.cli import cmd_drafter

            return cmd_drafter(args)
        if args.command == "serve":
            from outrider.server.cli import cmd_serve

            return cmd_serve(args)
        if args.command == "deploy":
            from outrider.server.cli import cmd_deploy

            return cmd_deploy(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"outrider: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
