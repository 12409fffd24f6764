"""`outrider` command line: `generate`, `serve`, `deploy`, `drafter`, `bench` and `plan`.

Start-up: building the parser imports argparse and the config dataclasses only. Each command's
flags are added when that command is chosen (`Commands`), and torch, the engine and the server
are imported inside the command functions, so `--help` and argument errors answer in a fraction
of a second (benchmarks/cli_startup.py measures it; tests/unit/test_cli_fast.py checks that
parsing imports no torch).

Every command's flags come from outrider/flags.py, which builds them from the config dataclasses
and imports no command module.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from outrider import env
from outrider.flags import (
    Commands,
    HelpFormatter,
    add_command,
    add_engine_flags,
    config_flag,
    engine_config,
    given,
)

# `generate`'s sampling flags: (field, type, SamplingParams' default, help). The defaults are
# written out for --help only, because outrider.core imports torch (~2 s on every call); a flag
# not given leaves SamplingParams' own default in force, and tests/unit/test_cli_fast.py keeps
# this table equal to it.
SAMPLING_FLAGS: tuple[tuple[str, type, Any, str], ...] = (
    ("top_p", float, 1.0, "keep the most likely tokens up to this probability mass; 1: off"),
    ("top_k", int, -1, "keep the K most likely tokens; -1 or 0: off"),
    ("min_p", float, 0.0, "drop tokens below this fraction of the top token's probability"),
    ("presence_penalty", float, 0.0, "penalize every token that already appeared, in [-2, 2]"),
    ("frequency_penalty", float, 0.0, "penalize tokens by how often they appeared, in [-2, 2]"),
    ("repetition_penalty", float, 1.0, "> 0; 1: off"),
    ("seed", int, None, "seeds sampling so a run at temperature > 0 is reproducible"),
    ("max_tokens", int, 256, "tokens to generate at most"),
    ("min_tokens", int, 0, "tokens generated before EOS or a stop string may end it"),
)


# -- outrider generate -------------------------------------------------------------------------


def _add_generate_flags(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", nargs="+", help="the prompt (several words are joined with spaces)")
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    add_engine_flags(gen)
    g = gen.add_argument_group("sampling")
    g.add_argument(
        "--temperature", dest="sampling.temperature", type=float, default=0.0,
        metavar="TEMPERATURE", help="0: greedy; > 0 samples",
    )  # fmt: skip
    for name, kind, default, doc in SAMPLING_FLAGS:
        config_flag(g, "sampling." + name, doc, type=kind, shown_default=default)
    config_flag(
        g, "sampling.stop", "a stop string (repeatable)", action="append", shown_default="none"
    )
    c = gen.add_argument_group("structured output (one of)")
    c.add_argument(
        "--json-schema", default=None, metavar="FILE",
        help="the output is JSON valid against the JSON schema in FILE (or given inline)",
    )  # fmt: skip
    c.add_argument("--regex", default=None, help="the output matches this regular expression")
    c.add_argument(
        "--choice", action="append", default=None, help="the output is one of these (repeatable)"
    )
    c.add_argument(
        "--grammar", default=None, metavar="FILE",
        help="the output follows the Lark or GBNF grammar in FILE",
    )  # fmt: skip


def structured_outputs(args: argparse.Namespace) -> dict | None:
    """The structured-output flags as SamplingParams.structured_outputs' fields; None for none.
    A file that does not exist or a schema that is not JSON fails here, naming the flag."""
    given = {
        name: value
        for name, value in (
            ("json", args.json_schema),
            ("regex", args.regex),
            ("choice", args.choice),
            ("grammar", args.grammar),
        )  # fmt: skip
        if value is not None
    }
    if not given:
        return None
    if len(given) > 1:
        flags = ", ".join("--" + {"json": "json-schema"}.get(n, n) for n in given)
        raise SystemExit(f"outrider generate: {flags}: give one structured-output flag at most")
    if "grammar" in given:
        given["grammar"] = _read(args.grammar, "--grammar")
    if "json" in given:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = _read(text, "--json-schema")
        try:
            given["json"] = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"outrider generate: --json-schema {args.json_schema}: not JSON ({e})"
            ) from None
    return given


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise SystemExit(
            f"outrider generate: {flag} {path}: {e.strerror}: give a readable file"
        ) from None


def cmd_generate(args: argparse.Namespace) -> int:
    config = engine_config(args)  # a bad value fails here, before torch is imported
    constraint = structured_outputs(args)

    from outrider.core import SamplingParams
    from outrider.llm import LLM

    params = SamplingParams(**given(args, "sampling"), structured_outputs=constraint)
    t0 = time.perf_counter()
    llm = LLM(config=config)
    load_s = time.perf_counter() - t0
    prompt: str | list[int] = " ".join(args.prompt)
    if not args.raw:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = llm.encode_chat(messages + [{"role": "user", "content": prompt}])
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
        controller = llm.engine.speculator.controller
        if controller is not None and not any(k for k in metrics["steps_by_k"]):
            # The adaptive controller kept speculation off: say on what figures.
            print(f"[outrider] speculation stayed off: {controller.explain()}", file=sys.stderr)
    if metrics.get("accept_length"):
        print(
            f"[outrider] speculative {config.speculative.method}: accept length "
            f"{metrics['accept_length']:.2f} ({metrics['num_accepted_tokens']}/"
            f"{metrics['num_draft_tokens']} drafts accepted)",
            file=sys.stderr,
        )
    print(
        f"[outrider] {n} tokens, {tps:.1f} tok/s decode, first token {ttft * 1000:.0f} ms, "
        f"prompt {metrics.get('num_prompt_tokens', 0)} tokens, model load {load_s:.1f} s "
        f"({llm.engine.runner.device}, {str(llm.engine.runner.dtype).removeprefix('torch.')})",
        file=sys.stderr,
    )
    # Stop the other tensor-parallel ranks now, not from interpreter teardown, where the order
    # of finalizers (the process group's among them) is not ours to choose; then leave without
    # that teardown at all, which aborted a finished rank 0 once in a while.
    llm.shutdown()
    if config.parallel.tensor_parallel_size > 1:
        from outrider.executor.tp_workers import leave_process

        leave_process(0)
    return 0


# -- the parser and main -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from outrider.bench.cli import add_bench_parser
    from outrider.plan.cli import add_plan_parser
    from outrider.server.cli import add_deploy_parser, add_serve_parser
    from outrider.train.cli import add_drafter_parser

    parser = argparse.ArgumentParser(
        prog="outrider",
        description="LLM inference built around speculative decoding that pays off.",
        epilog="Run `outrider COMMAND --help` for a command's options.",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, action=Commands
    )
    add_command(
        commands,
        "generate",
        _add_generate_flags,
        help="generate a completion for a prompt and stream it to stdout",
        description="Stream a completion to stdout (the model's chat template is applied unless "
        "--raw); throughput goes to stderr.",
    )
    add_serve_parser(commands)
    add_drafter_parser(commands)
    add_deploy_parser(commands)
    add_bench_parser(commands)
    add_plan_parser(commands)
    return parser


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` chose, the deepest one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen(action.choices[name], args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # answered with the chosen command's usage, which lists its flags
        _chosen(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    level = logging.INFO if getattr(args, "verbose", False) else env.log_level()
    logging.basicConfig(level=level, format=env.LOG_FORMAT)
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
        if args.command == "bench":
            from outrider.bench.cli import cmd_bench

            return cmd_bench(args)
        if args.command == "plan":
            from outrider.plan.cli import cmd_plan

            return cmd_plan(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"outrider: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
