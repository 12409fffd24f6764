"""`outrider serve` (and `outrider deploy`): flags, their defaults read from ServerConfig and the
engine's configs, and one YAML file (`--config`) holding both. A flag overrides the YAML only
when it differs from the dataclass default, as for `outrider generate`."""

from __future__ import annotations

import argparse
import dataclasses

from outrider.config import EngineConfig
from outrider.server.config import ServerConfig, load_yaml

# ServerConfig fields exposed as flags: (field, type). Tuples become repeatable flags.
_SERVER_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("host", str, "address to listen on"),
    ("port", int, "port to listen on (0: any free port)"),
    ("api_key", str, "require 'Authorization: Bearer KEY' on every endpoint but /health"),
    ("api_key_file", str, "read the API key from this file (keeps it out of ps and the unit)"),
    ("served_model_name", str, "the model id clients send (default: the checkpoint's name)"),
    ("max_body_bytes", int, "larger request bodies get 413"),
    ("max_n", int, "most choices (n) per request"),
    ("default_max_tokens", int, "max_tokens when a request gives none (default: the context)"),
    ("shutdown_timeout", float, "seconds SIGTERM waits for in-flight requests before aborting"),
    ("tool_parser", str, "parse tool calls: hermes, qwen or kimi_k2"),
    ("reasoning_parser", str, "split reasoning_content: think or deepseek_r1"),
    ("chat_template", str, "a jinja chat template file replacing the checkpoint's"),
    ("health_stall_s", float, "/health fails when a busy engine has not stepped this long"),
    ("log_level", str, "uvicorn log level: critical, error, warning, info, debug"),
)


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from outrider.cli import _add_engine_flags

    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API (chat, completions, models, health, metrics)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
        "/metrics. --config takes one YAML file with a `server:` section (ServerConfig) and "
        "the engine's sections (model, cache, scheduler, speculative).",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    group = p.add_argument_group("server")
    for name, kind, doc in _SERVER_FLAGS:
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=defaults[name],
            help=f"{doc} (default: {defaults[name]})",
        )
    group.add_argument(
        "--cors-origin",
        dest="cors_origins",
        action="append",
        default=None,
        help="allow browser calls from this origin (repeatable; default: CORS off)",
    )
    _add_engine_flags(p)
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    from outrider.cli import _engine_config

    server_base, engine_base = (
        load_yaml(args.config) if args.config else (ServerConfig(), EngineConfig())
    )
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    changes = {
        name: getattr(args, name)
        for name, _, _ in _SERVER_FLAGS
        if getattr(args, name) != defaults[name]
    }
    if args.cors_origins:
        changes["cors_origins"] = tuple(args.cors_origins)
    if "api_key" in changes:  # a flag key replaces a YAML key file, and the reverse
        changes.setdefault("api_key_file", None)
    elif "api_key_file" in changes:
        changes.setdefault("api_key", None)
    server = dataclasses.replace(server_base, **changes)
    # The engine flags, applied on top of the YAML exactly as `generate` applies them.
    flags_only = _engine_config(argparse.Namespace(**{**vars(args), "config": None}))
    default = EngineConfig()
    overrides = {
        f.name: {
            k: v
            for k, v in dataclasses.asdict(getattr(flags_only, f.name)).items()
            if v != dataclasses.asdict(getattr(default, f.name))[k]
        }
        for f in dataclasses.fields(EngineConfig)
    }
    return server, engine_base.replace(**overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from outrider.server.server import serve

    server_config, engine_config = configs_from_args(args)
    return serve(server_config, engine_config)


def add_deploy_parser(sub) -> argparse.ArgumentParser:
    from outrider.server.deploy import DeployOptions

    p = sub.add_parser(
        "deploy",
        help="write (and optionally install) a systemd service for `outrider serve`",
        description="Write outrider.service, outrider.env, the frozen server.yaml and "
        "production.md to --output; --install copies them into place and enables the unit.",
    )
    p.add_argument("target", choices=("systemd",), help="what to deploy to")
    p.add_argument("--config", required=True, help="the server YAML (server + engine sections)")
    p.add_argument("--output", required=True, help="directory to write the files into")
    opts = DeployOptions()
    p.add_argument("--user", default=opts.user, help="the service's dedicated user (must exist)")
    p.add_argument("--python", default=opts.python, help="interpreter the unit runs")
    p.add_argument("--limit-nofile", type=int, default=opts.limit_nofile)
    p.add_argument(
        "--install",
        action="store_true",
        help="copy into /etc (keeping replaced files) and run systemctl daemon-reload && enable",
    )
    p.add_argument("--root", default="/", help="install under this root (image builds)")
    p.add_argument("--systemctl", default="systemctl", help="the systemctl to run")
    return p


def cmd_deploy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outrider.server.deploy import DeployOptions, install, write_bundle

    server, engine = load_yaml(args.config)
    opts = DeployOptions(user=args.user, python=args.python, limit_nofile=args.limit_nofile)
    bundle = write_bundle(server, engine, Path(args.output), opts)
    for path in bundle.values():
        print(f"wrote {path}")
    if args.install:
        install(bundle, root=Path(args.root), systemctl=args.systemctl)
    return 0
