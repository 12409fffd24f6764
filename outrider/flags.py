"""The flags of every command, built from the config dataclasses: one module that `outrider`'s
commands (generate, serve, deploy, drafter, bench) import, and that imports none of them.

Config flags name their field as their dest ("cache.num_blocks") and default to SUPPRESS, so
the namespace holds exactly the flags given: a flag given wins over the YAML whatever its value,
and one not given leaves the YAML (or the dataclass default) alone. Their help shows the
dataclass default; every other flag's default is shown by `HelpFormatter`, once.

Start-up: importing this module imports argparse, the config dataclasses and the proposer
registry's names only (no torch).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from outrider.config import (
    CPU_LONG_PREFILL_TOKENS,
    DTYPES,
    FLAT_ALIASES,
    SECTIONS,
    SPEC_CONTROLLERS,
    VLLM_SPEC_KEYS,
    EngineConfig,
    SpecConfig,
    flat_sections,
)
from outrider.config_fields import defaults
from outrider.engine.proposers import proposer_names

log = logging.getLogger(__name__)

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
    given. Its names default to --field-name, and the field's other spellings in FLAT_ALIASES
    (what YAML accepts, the CLI accepts) follow; --help shows `shown_default`, by default the
    engine config field's own."""
    section, field = dest.split(".", 1)
    if shown_default is _FIELD_DEFAULT:
        shown_default = defaults(SECTIONS[section])[field]
    names = names or ("--" + field.replace("_", "-"),)
    aliases = (
        "--" + a.replace("_", "-") for a, to in FLAT_ALIASES.items() if to == (section, field)
    )
    names = tuple(dict.fromkeys([*names, *aliases]))
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
        "--num-blocks", type=int, metavar="N",
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
    config_flag(
        g, "cache.enable_prefix_caching",
        "reuse the KV of prompt prefixes seen before (--no-enable-prefix-caching: off)",
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
    )  # fmt: skip


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--config", default=None, help="a YAML engine config; flags given override it")
    config_flag(
        g, "model.model",
        "a .gguf file, an HF model directory or an HF repo id in the local HF cache (default: "
        "the embedded SmolLM2-135M-Instruct)",
    )  # fmt: skip
    config_flag(g, "model.dtype", "auto: bfloat16 on CUDA, float32 on CPU", choices=DTYPES)
    config_flag(g, "model.device", "auto, cpu, cuda or cuda:N")
    config_flag(
        g,
        "model.max_model_len",
        "the longest sequence, prompt and output, in tokens (default: the checkpoint's)",
        type=int,
    )
    config_flag(g, "scheduler.max_num_seqs", "most sequences in one batch", type=int)
    config_flag(
        g, "scheduler.max_num_batched_tokens",
        "most tokens in one step; longer prompts are prefilled in chunks of it", type=int,
    )  # fmt: skip
    config_flag(
        g, "model.cuda_graphs", "run every step eagerly (no CUDA graphs: debugging, profiling)",
        "--enforce-eager", action="store_const", const=False, shown_default="off",
    )  # fmt: skip
    config_flag(
        g, "parallel.tensor_parallel_size",
        "GPUs (or CPU processes) the model is split over; under torchrun, the world size",
        "--tensor-parallel-size", "-tp", type=int, metavar="N",
    )  # fmt: skip
    g.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    add_cache_flags(p)
    g = p.add_argument_group("speculative decoding")
    config_flag(
        g, "speculative.method", "draft ahead of the model and verify in one forward (default: off)",
        "--spec", choices=proposer_names(), type=_method,
    )  # fmt: skip
    g.add_argument(
        "--speculative-config", dest="speculative_config",
        default=argparse.SUPPRESS, metavar="JSON",
        help="vLLM's form: a JSON object with method, model, num_speculative_tokens, "
        "prompt_lookup_min/max (or this group's names); this group's flags add to it, and one "
        "that disagrees with it is an error",
    )  # fmt: skip
    config_flag(g, "speculative.num_draft_tokens", "drafts verified per step (k)", type=int)
    config_flag(
        g, "speculative.draft",
        "EAGLE-3: the drafter's directory (default: the one shipped for the default model)",
    )  # fmt: skip
    config_flag(g, "speculative.num_steps", "EAGLE-3 tree: draft steps (default: k)", type=int)
    config_flag(g, "speculative.topk", "EAGLE-3 tree: candidates per step (1: chain)", type=int)
    config_flag(
        g, "speculative.draft_tensor_parallel_size",
        "EAGLE-3 under tensor parallelism: 1 runs the drafter on rank 0 alone; the "
        "--tensor-parallel-size splits it like the model over every rank",
        type=int, metavar="N",
    )  # fmt: skip
    config_flag(
        g, "speculative.controller",
        "adaptive: choose how many drafts to verify each step (0 where speculation would lose, "
        "from step times measured at start-up); fixed: always --num-draft-tokens",
        "--spec-controller", choices=SPEC_CONTROLLERS,
    )  # fmt: skip
    g = p.add_argument_group(
        "SGLang's speculative flags",
        "translated: its --speculative-num-draft-tokens counts the "
        "root token, so N there verifies N - 1 drafts here; with topk 1 its num-steps is the "
        "chain's length",
    )
    for name, field, kind, doc in (
        ("algorithm", "algorithm", str, "EAGLE3 or NGRAM (--spec)"),
        ("draft-model-path", "draft", str, "the EAGLE-3 drafter's directory (--draft)"),
        ("num-steps", "num_steps", int, "draft steps (--num-steps; a chain's length)"),
        ("eagle-topk", "topk", int, "candidates per step (--topk)"),
        ("num-draft-tokens", "num_draft_tokens", int, "root + drafts (--num-draft-tokens + 1)"),
    ):
        g.add_argument(
            f"--speculative-{name}", dest="sglang." + field, type=kind,
            default=argparse.SUPPRESS, metavar=field.upper(), help=doc,
        )  # fmt: skip
    add_generated_engine_flags(p)


# Engine fields without a generated flag: generate's --seed is the sampling seed (serve adds
# --seed for the engine's).
_NOT_GENERATED = frozenset({"model.seed"})

# --help of the generated flags, by field: what each does and its unit.
_GENERATED_HELP = {
    "model.attention_backend": "the attention kernels: auto (triton on CUDA, torch_ref on "
    "CPU) or a registered backend's name",
    "model.deterministic": "batch-invariant kernels: every row is computed in an order that "
    "depends on that row alone, so output is the same at any batch size or concurrency and "
    "greedy speculative output equals plain output bit for bit, in bf16 too; slower "
    "(--enable-deterministic-inference: SGLang's name)",
    "model.cuda_graph_max_batch": "the largest decode batch captured as a CUDA graph; larger "
    "batches run eagerly",
    "model.cuda_graph_prefill_tokens": "steps of prompt chunks of up to this many tokens "
    "replay CUDA graphs too; longer ones run eagerly (0: all eagerly)",
    "model.cuda_graph_mixed_prefill": "steps with prompt chunks beside decode rows (requests "
    "arriving while others decode) replay those graphs too (--no-cuda-graph-mixed-prefill: "
    "they run eagerly)",
    "scheduler.enable_chunked_prefill": "prefill prompts longer than --max-num-batched-tokens "
    "in chunks of it (--no-enable-chunked-prefill: off)",
    "scheduler.long_prefill_token_threshold": "a prompt with more tokens than this still to "
    "prefill is long: it computes at most this many a step, after decodes and short prompts "
    f"(0: no prompt is long; default: {CPU_LONG_PREFILL_TOKENS} on CPU, "
    "--max-num-batched-tokens on CUDA)",
    "scheduler.max_long_partial_prefills": "long prompts (--long-prefill-token-threshold) "
    "prefilled in one step, those with the fewest tokens left; the others wait",
    "scheduler.async_scheduling": "launch the next plain decode step before reading this "
    "one's tokens, overlapping host bookkeeping with the device; with speculation, the steps "
    "the adaptive controller keeps plain (default: on CUDA, off on the CPU)",
    "speculative.grammar_drafts": "structured outputs: a constrained request's drafts start "
    "with the tokens its grammar forces (--no-grammar-drafts: the proposer's own only)",
    "speculative.ngram_min_n": "n-gram drafting: the shortest suffix matched in the context, "
    "in tokens",
    "speculative.ngram_max_n": "n-gram drafting: the longest suffix matched in the context, "
    "in tokens",
    "parallel.collective_timeout_s": "seconds one eager collective inside a step may wait "
    "under tensor parallelism before the step fails",
}


def add_generated_engine_flags(p: argparse.ArgumentParser) -> None:
    """A flag for every engine config field that has none written above (--field-name, typed
    from its annotation: a bool gets --x/--no-x), so every field is settable from the CLI."""
    import typing

    taken = {a.dest for a in p._actions}
    g = p.add_argument_group("more engine settings (config fields, see outrider/config.py)")
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            dest = f"{section}.{f.name}"
            flag = "--" + f.name.replace("_", "-")
            if dest in taken or dest in _NOT_GENERATED or flag in p._option_string_actions:
                continue
            kind = field_type(hints[f.name])
            doc = _GENERATED_HELP.get(dest, "")
            if kind is bool:
                config_flag(g, dest, doc, flag, action=argparse.BooleanOptionalAction)
            else:
                config_flag(g, dest, doc, flag, type=kind)


def field_type(hint: Any) -> Any:
    """A field's type for argparse: int | None -> int; str -> str; tuple[int, ...] | None ->
    tuple[int, ...]."""
    import types
    import typing

    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _method(text: str) -> str:
    """A speculative method in any case and spelling (EAGLE3, Eagle-3, [ngram])."""
    try:
        return str(SpecConfig.normalize({"method": text})["method"])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The engine flags given, by config section: EngineConfig.replace(**engine_overrides(a))."""
    return {section: given(args, section) for section in SECTIONS}


def engine_config(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    """`base` (default: --config's YAML, else the dataclass defaults) with the flags given:
    vLLM's --speculative-config and SGLang's speculative flags first,
    outrider's own flags over them."""
    if base is None:
        base = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    overrides = engine_overrides(args)
    foreign = {k: getattr(args, k) for k in ("speculative_config",) if hasattr(args, k)}
    sections = flat_sections(foreign)
    if "speculative_config" in foreign:
        refuse_disagreement(foreign["speculative_config"], overrides["speculative"])
    sglang = given(args, "sglang")
    if sglang:
        native = [f"--{k.replace('_', '-')}" for k in overrides["speculative"]]
        sections["speculative"].update(sglang_speculative(sglang, native))
    for name, values in sections.items():
        overrides[name] = {**values, **overrides[name]}
    return base.replace(**overrides)


def refuse_disagreement(spec_json: str, flags: dict[str, Any]) -> None:
    """--speculative-config merges with the speculative flags given beside it (--spec, --draft,
    --num-draft-tokens, ...) where they set other keys or the same value; a key both set to two
    values is an error naming both, as neither could be called the one the user meant."""
    written = {}
    for key in json.loads(spec_json):  # flat_sections has read it: a JSON object
        name = str(key).replace("-", "_")
        written[VLLM_SPEC_KEYS.get(name, name)] = str(key)
    spec = SpecConfig.normalize(json.loads(spec_json))
    clashes = [
        f"{_spec_flag(name)} {flags[name]} (its {written.get(name, name)!r} is {spec[name]!r})"
        for name in spec
        if name in flags and flags[name] != spec[name]
    ]
    if clashes:
        raise ValueError(
            f"--speculative-config {spec_json} disagrees with {' and '.join(clashes)}: give "
            "each setting once; flags beside --speculative-config merge with it only where "
            "they agree or set other keys"
        )


def _spec_flag(field: str) -> str:
    """The flag of a SpecConfig field: --spec for method, else --field-name."""
    alias = next((a for a, to in FLAT_ALIASES.items() if to == ("speculative", field)), field)
    return "--" + alias.replace("_", "-")


def sglang_speculative(values: dict[str, Any], native: list[str] = ()) -> dict[str, Any]:
    """SGLang's speculative flags (algorithm, draft, num_steps, topk, num_draft_tokens) ->
    SpecConfig fields. SGLang's num_draft_tokens counts the root: N there is N - 1 drafts here
    (steps 3, topk 1, draft tokens 4 is a chain of 3). With topk 1 SGLang's num_steps is the
    chain's length; with topk > 1 it is the tree's depth, as here. `native`: outrider's own
    speculative flags given beside them, which win (a warning says so when it could confuse)."""
    out: dict[str, Any] = {}
    if "algorithm" in values:
        out["method"] = values["algorithm"]
    if "draft" in values:
        out["draft"] = values["draft"]
    topk, steps, n = values.get("topk"), values.get("num_steps"), values.get("num_draft_tokens")
    if topk is not None:
        out["topk"] = topk
    if n is not None:
        if n < 2:
            raise ValueError(
                f"--speculative-num-draft-tokens {n}: SGLang counts the root token, so use at "
                "least 2 (one draft)"
            )
        out["num_draft_tokens"] = n - 1
    if steps is not None and (topk or 1) == 1:
        if n is not None and n - 1 != steps:
            raise ValueError(
                f"--speculative-num-steps {steps} and --speculative-num-draft-tokens {n} "
                f"disagree for a chain (topk 1): SGLang counts the root, so steps {steps} "
                f"needs num-draft-tokens {steps + 1}"
            )
        out["num_draft_tokens"] = steps
    elif steps is not None:
        out["num_steps"] = steps
    if native and n is not None:
        log.warning(
            "both SGLang's --speculative-num-draft-tokens %d (root included: %d drafts) and "
            "outrider's %s given: outrider's win",
            n, n - 1, ", ".join(native),
        )  # fmt: skip
    return SpecConfig.normalize(out)
