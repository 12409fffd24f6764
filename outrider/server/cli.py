"""`outrider serve` (and `outrider deploy`): flags, their defaults read from ServerConfig and the
engine's configs, and one YAML file (`--config`) holding both. As for `outrider generate`, a flag
given overrides the YAML whatever its value, and one not given leaves it alone (flags.py)."""

from __future__ import annotations

import argparse
import dataclasses

from outrider.config import EngineConfig
from outrider.flags import add_command, add_engine_flags, config_flag, engine_config, given
from outrider.server.config import SERVER_ALIASES, ServerConfig, load_yaml

# ServerConfig fields exposed as flags: (field, type, help).
_SERVER_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("host", str, "address to listen on"),
    ("port", int, "port to listen on (0: any free port)"),
    ("api_key", str, "require 'Authorization: Bearer KEY' on every endpoint but /health"),
    ("api_key_file", str, "read the API key from this file (keeps it out of ps and the unit)"),
    ("served_model_name", str, "the model id clients send (default: the checkpoint's name)"),
    ("max_body_bytes", int, "larger request bodies get 413"),
    ("max_n", int, "most choices (n) per request"),
    ("max_stop_strings", int, "most stop strings per request (each is matched every step)"),
    ("max_stop_string_chars", int, "most characters in one stop string"),
    ("max_stop_token_ids", int, "most stop_token_ids per request"),
    ("max_tools", int, "most tools per chat request"),
    (
        "max_tools_chars",
        int,
        "most characters in a chat request's tools, as JSON (they are rendered into the prompt)",
    ),
    ("max_logprobs", int, "most top logprobs per token a request may ask for (20 at most)"),
    (
        "max_prompt_chars",
        int,
        "most characters of text in a prompt or in all of a chat's messages, checked before "
        "tokenizing",
    ),
    ("default_max_tokens", int, "max_tokens when a request gives none (default: the context)"),
    ("shutdown_timeout", float, "seconds SIGTERM waits for in-flight requests before aborting"),
    (
        "header_timeout",
        float,
        "seconds a connection may take to send its request line and headers, then 408 and closed",
    ),
    (
        "max_connections",
        int,
        "open connections served at once; a request on one beyond gets 503 and is closed",
    ),
    (
        "max_concurrent_requests",
        int,
        "POST requests in flight at once; more get 503 (default: no cap beyond max_connections)",
    ),
    ("tool_parser", str, "parse tool calls: hermes, qwen or kimi_k2"),
    ("reasoning_parser", str, "split reasoning_content: think or deepseek_r1"),
    ("chat_template", str, "a jinja chat template file replacing the checkpoint's"),
    (
        "chat_template_timeout_s",
        float,
        "seconds one render of the chat template may take; a request past it gets 400",
    ),
    (
        "chat_template_max_chars",
        int,
        "characters one render of the chat template may write or build (each string it makes "
        "counts); a request past it gets 400",
    ),
    (
        "health_stall_s",
        float,
        "/health fails (and the systemd watchdog stops) when the engine "
        "thread has not shown progress this long (at least; longer if its steps are that slow)",
    ),
    ("log_level", str, "uvicorn log level: critical, error, warning, info, debug"),
    (
        "metrics_prefix",
        str,
        "name /metrics series outrider:* or vllm:* (vllm: vLLM's dashboards read them as is)",
    ),
)


def add_serve_parser(commands) -> argparse.ArgumentParser:
    """Add `serve` to the top-level commands (its flags when it is chosen: cli.add_command)."""
    return add_command(
        commands,
        "serve",
        _add_serve_flags,
        help="serve an OpenAI-compatible API (chat, completions, models, health, metrics)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
        "/metrics. --config takes one YAML file with a `server:` section (ServerConfig) and "
        "the engine's sections (model, cache, scheduler, speculative, parallel).",
    )


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    p.add_argument(
        "model_positional", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
        help="the model, as vLLM's `vllm serve MODEL` takes it (same as --model)",
    )  # fmt: skip
    group = p.add_argument_group("server")
    for name, kind, doc in _SERVER_FLAGS:
        names = ["--" + n.replace("_", "-") for n in (name, *_aliases(name))]
        config_flag(group, "server." + name, doc, *names, type=kind, shown_default=defaults[name])
    group.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM's command lines: tool calls are parsed whenever --tool-parser "
        "is set",
    )  # fmt: skip
    config_flag(
        group, "model.seed",
        "the engine config's seed (accepted for vLLM's command lines); a request's own seed "
        "makes its sampling reproducible",
        type=int,
    )  # fmt: skip
    config_flag(
        group, "server.engine_process",
        "step the engine in a process of its own, beside the HTTP server's (--no-engine-process: "
        "in a thread of the same process, where both share one interpreter)",
        "--engine-process", action=argparse.BooleanOptionalAction,
        shown_default=defaults["engine_process"],
    )  # fmt: skip
    config_flag(
        group, "server.cors_origins",
        "allow browser calls from this origin (repeatable; default: CORS off)",
        "--cors-origin", action="append", shown_default=defaults["cors_origins"],
    )  # fmt: skip
    add_engine_flags(p)


def _aliases(field: str) -> list[str]:
    return [alias for alias, to in SERVER_ALIASES.items() if to == field]


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    model = vars(args).pop("model_positional", None)
    if model is not None:
        flag = getattr(args, "model.model", None)
        if flag is not None and flag != model:
            raise ValueError(
                f"two models given: {model!r} (positional) and --model {flag!r}: pass one"
            )
        setattr(args, "model.model", model)
    server_base, engine_base = (
        load_yaml(args.config) if args.config else (ServerConfig(), EngineConfig())
    )
    changes = given(args, "server")
    if "api_key" in changes:  # a flag key replaces a YAML key file, and the reverse
        changes.setdefault("api_key_file", None)
    elif "api_key_file" in changes:
        changes.setdefault("api_key", None)
    server = dataclasses.replace(server_base, **changes)
    return server, engine_config(args, engine_base)


def cmd_serve(args: argparse.Namespace) -> int:
    server_config, engine = configs_from_args(args)  # bad values fail before the imports
    spawned = None
    if server_config.engine_process:
        # Started before the server's own imports (about 2 s on 2 cores), which its own overlap.
        from outrider.server.engine_main import spawn

        spawned = spawn(engine, server_config.health_stall_s)
    try:
        from outrider.server.server import serve

        return serve(server_config, engine, spawned)
    except BaseException:
        if spawned is not None:  # (a no-op once the server has stopped it)
            spawned.kill()
        raise


def add_deploy_parser(commands) -> argparse.ArgumentParser:
    """Add `deploy` to the top-level commands (its flags when it is chosen: cli.add_command)."""
    return add_command(
        commands,
        "deploy",
        _add_deploy_flags,
        help="write (and optionally install) a systemd service for `outrider serve`",
        description="Write outrider.service, outrider.env, the frozen server.yaml and "
        "production.md to --output; --install copies them into place and enables the unit.",
    )


def _add_deploy_flags(p: argparse.ArgumentParser) -> None:
    from outrider.server.deploy import DeployOptions

    p.add_argument("target", choices=("systemd",), help="what to deploy to")
    p.add_argument("--config", required=True, help="the server YAML (server + engine sections)")
    p.add_argument("--output", required=True, help="directory to write the files into")
    opts = DeployOptions()
    p.add_argument("--user", default=opts.user, help="the service's dedicated user (must exist)")
    p.add_argument("--python", default=opts.python, help="interpreter the unit runs")
    p.add_argument(
        "--limit-nofile",
        type=int,
        default=opts.limit_nofile,
        help="the unit's LimitNOFILE=: open files (sockets included) the server may hold",
    )
    p.add_argument(
        "--install",
        action="store_true",
        help="copy into /etc (keeping replaced files) and run systemctl daemon-reload && enable",
    )
    p.add_argument(
        "--env-file", default=None, metavar="PATH",
        help="an extra KEY=VALUE environment file the unit reads after outrider.env (e.g. "
        "`outrider bench comm`'s NCCL settings); installed beside it in /etc/outrider",
    )  # fmt: skip
    p.add_argument(
        "--root", default="/",
        help="install under this root (image builds); the api_key_file is looked for there too",
    )  # fmt: skip
    p.add_argument("--systemctl", default="systemctl", help="the systemctl program --install runs")
    p.add_argument(
        "--dry-run", action="store_true",
        help="print the unit and what would be written, copied and run (with --install), and "
        "change nothing",
    )  # fmt: skip


def cmd_deploy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outrider.server.deploy import (
        DeployOptions,
        bundle_texts,
        check_startable,
        dry_run,
        install,
        write_bundle,
    )

    server, engine = load_yaml(args.config)
    opts = DeployOptions(
        user=args.user,
        python=args.python,
        limit_nofile=args.limit_nofile,
        env_file=Path(args.env_file) if args.env_file else None,
    )
    check_startable(server, engine, opts, Path(args.root))
    if args.dry_run:
        files = bundle_texts(server, engine, opts)
        print(dry_run(files, Path(args.output), args.install, Path(args.root), args.systemctl))
        return 0
    bundle = write_bundle(server, engine, Path(args.output), opts)
    for path in bundle.values():
        print(f"wrote {path}")
    if args.install:
        install(bundle, root=Path(args.root), systemctl=args.systemctl)
    return 0
