"""`outrider` command line: `generate`, `serve`, `deploy` and `drafter`.

Start-up: building the parser imports argparse and the config dataclasses only. Each command's
flags are added when that command is chosen (`Commands`), and torch, the engine and the server
are imported inside the command functions, so `--help` and argument errors answer in a fraction
of a second (benchmarks/cli_startup.py measures it; tests/unit/test_cli_fast.py checks that
parsing imports no torch).

Config flags name their field as their dest ("cache.num_blocks") and default to SUPPRESS, so
the namespace holds exactly the flags given: a flag given wins over the YAML whatever its value,
and one not given leaves the YAML (or the dataclass default) alone. Their help shows the
dataclass default; every other flag's default is shown by `HelpFormatter`, once.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from outrider import env
from outrider.config import (
    DTYPES,
    SPEC_CONTROLLERS,
    SPEC_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
    defaults,
)

# The engine's config sections, as `--config` YAML and `EngineConfig.replace` name them.
ENGINE_CONFIGS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpecConfig,
}

# `generate`'s sampling flags: (field, type, SamplingParams' default, help). The defaults are
# written out for --help only, because outrider.core imports torch (~2 s on every call); a flag
# not given leaves SamplingParams' own default in force, and tests/unit/test_cli_fast.py keeps
# this table equal to it.
SAMPLING_FLAGS: tuple[tuple[str, type, Any, str], ...] = (
    ("top_p", float, 1.0, "keep the most likely tokens up to this probability mass; 1: off"),
    ("top_k", int, -1, "keep the K most likely tokens; -1 or 0: off"),
    ("min_p", float, 0.0, "drop tokens below this fraction of the top token's probability"),
    ("presence_penalty", float, 0.0, "in [-2, 2]"),
    ("frequency_penalty", float, 0.0, "in [-2, 2]"),
    ("repetition_penalty", float, 1.0, "> 0; 1: off"),
    ("seed", int, None, "makes sampling reproducible"),
    ("max_tokens", int, 256, "tokens to generate at most"),
    ("min_tokens", int, 0, "tokens generated before EOS or a stop string may end it"),
)


# -- argparse plumbing shared by every command -------------------------------------------------


def with_default(doc: str, default: Any) -> str:
    """`doc` with its default appended, unless `doc` already states one."""
    return doc if "default:" in doc else f"{doc} (default: {default})"


class HelpFormatter(argparse.HelpFormatter):
    """Shows every flag's default once: appended to its help (or as its help, where it has
    none) unless the help already states it, as config flags do (their own default is
    SUPPRESS). Switches (store_true), required flags and positionals show none."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return with_default(text, "%(default)s") if _shows_default(action) else text


def _shows_default(action: argparse.Action) -> bool:
    switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
    positional = not action.option_strings
    return not (switch or positional or action.required or action.default is argparse.SUPPRESS)


class Commands(argparse._SubParsersAction):
    """Subcommands whose flags are added only when the command is chosen on the command line
    (see `add_command`): `outrider --help` lists the commands without importing what their
    flags need (the drafter's training configs import torch). Invariant: a command's flags are
    added at most once, before its parser reads its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fill: dict[str, Callable[[], None]] = {}

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        fill = self.fill.pop(values[0], None)
        if fill is not None:
            fill()
        super().__call__(parser, namespace, values, option_string)


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    fill: Callable[[argparse.ArgumentParser], None],
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """Add the command `name`, whose flags `fill` adds: when it is chosen under `Commands`, at
    once under a plain subparsers action (a caller's own parser)."""
    kwargs.setdefault("formatter_class", HelpFormatter)
    parser = subparsers.add_parser(name, **kwargs)
    if isinstance(subparsers, Commands):
        subparsers.fill[name] = lambda: fill(parser)
    else:
        fill(parser)
    return parser


_FIELD_DEFAULT = object()


def config_flag(
    group, dest: str, help: str, *names: str, shown_default: Any = _FIELD_DEFAULT, **kwargs: Any
) -> None:
    """A flag for the config field `dest` ("section.field"), present in the namespace only when
    given. Its names default to --field-name; --help shows `shown_default`, by default the
    engine config field's own."""
    section, field = dest.split(".", 1)
    if shown_default is _FIELD_DEFAULT:
        shown_default = defaults(ENGINE_CONFIGS[section])[field]
    names = names or ("--" + field.replace("_", "-"),)
    if "choices" not in kwargs and kwargs.get("action") in (None, "append"):
        kwargs.setdefault("metavar", field.upper())
    help = with_default(help, shown_default)
    group.add_argument(*names, dest=dest, default=argparse.SUPPRESS, help=help, **kwargs)


def given(args: argparse.Namespace, section: str) -> dict[str, Any]:
    """The config flags of `section` that were given, by field name."""
    prefix = section + "."
    return {k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix)}


def byte_size(text: str) -> int:
    """A byte count: 1073741824, 1G, 512M or 64K (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid byte count {text!r}: use an integer or a K, M or G suffix, e.g. 4G"
        ) from None


# -- engine flags: generate, serve and the drafter commands that build an engine ---------------


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """The KV pool's size, the same flags for every command that builds an engine."""
    g = p.add_argument_group("KV cache")
    config_flag(g, "cache.block_size", "tokens per KV block (a power of two)", type=int)
    config_flag(
        g, "cache.num_blocks",
        "fix the pool at N blocks, overriding both memory budgets (default: sized from "
        "--gpu-memory-utilization on CUDA, --cpu-kv-bytes on CPU)",
        "--num-blocks", "--num-gpu-blocks", "--num-gpu-blocks-override", type=int, metavar="N",
    )  # fmt: skip
    config_flag(
        g, "cache.gpu_memory_utilization",
        "CUDA: the fraction of the GPU's memory the engine may fill, weights and other "
        "processes included; the KV pool gets what is left",
        type=float,
    )  # fmt: skip
    config_flag(
        g, "cache.cpu_kv_bytes", "CPU: the KV pool's byte budget (K, M, G: binary units)",
        type=byte_size, metavar="BYTES",
    )  # fmt: skip


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--config", default=None, help="a YAML engine config; flags given override it")
    config_flag(
        g, "model.model",
        "a .gguf file or an HF model directory (default: the embedded SmolLM2-135M-Instruct)",
    )  # fmt: skip
    config_flag(g, "model.dtype", "auto: bfloat16 on CUDA, float32 on CPU", choices=DTYPES)
    config_flag(g, "model.device", "auto, cpu, cuda or cuda:N")
    config_flag(
        g, "model.max_model_len", "the longest sequence (default: the checkpoint's)", type=int
    )
    config_flag(g, "scheduler.max_num_seqs", "most sequences in one batch", type=int)
    g.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    add_cache_flags(p)
    g = p.add_argument_group("speculative decoding")
    config_flag(
        g, "speculative.method", "draft ahead of the model and verify in one forward (default: off)",
        "--spec", choices=SPEC_METHODS,
    )  # fmt: skip
    config_flag(g, "speculative.num_draft_tokens", "drafts verified per step (k)", type=int)
    config_flag(
        g, "speculative.draft",
        "EAGLE-3: the drafter's directory (default: the one shipped for the default model)",
    )  # fmt: skip
    config_flag(g, "speculative.num_steps", "EAGLE-3 tree: draft steps (default: k)", type=int)
    config_flag(g, "speculative.topk", "EAGLE-3 tree: candidates per step (1: chain)", type=int)
    config_flag(
        g, "speculative.controller",
        "adaptive: choose how many drafts to verify each step (0 where speculation would lose, "
        "from step times measured at start-up); fixed: always --num-draft-tokens",
        "--spec-controller", choices=SPEC_CONTROLLERS,
    )  # fmt: skip


def engine_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The engine flags given, by config section: EngineConfig.replace(**engine_overrides(a))."""
    return {section: given(args, section) for section in ENGINE_CONFIGS}


def engine_config(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    """`base` (default: --config's YAML, else the dataclass defaults) with the flags given."""
    if base is None:
        base = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    return base.replace(**engine_overrides(args))


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


def cmd_generate(args: argparse.Namespace) -> int:
    config = engine_config(args)  # a bad value fails here, before torch is imported

    from outrider.core import SamplingParams
    from outrider.llm import LLM

    params = SamplingParams(**given(args, "sampling"))
    t0 = time.perf_counter()
    llm = LLM(config=config)
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
    return 0


# -- the parser and main -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
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
    return parser


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
