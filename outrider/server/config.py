"""ServerConfig: the HTTP side of `outrider serve`, frozen and validated like the engine's configs.

One YAML file holds both: a `server:` section for this class and the engine's sections
(`model`, `cache`, `scheduler`, `speculative`, `parallel`) for `EngineConfig`:

    server: {host: 0.0.0.0, port: 8000, api_key_file: /etc/outrider/key, max_n: 4}
    model: {model: /srv/models/model.gguf, dtype: bfloat16}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outrider.config import SECTIONS, EngineConfig, flat_names
from outrider.config_fields import build_section, check_types, close_matches, read_yaml
from outrider.loaders.chat_template import TemplateLimits

METRICS_PREFIXES = ("outrider", "vllm")  # of /metrics series: vllm for vLLM's dashboards
# Bounds on one request that must be positive (max_logprobs may be 0: no top logprobs).
REQUEST_LIMITS = ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                  "max_tools", "max_tools_chars", "max_prompt_chars")  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    """Invariants after construction: 0 <= port <= 65535, at most one of api_key and
    api_key_file, every limit positive (max_logprobs in 0..20), parsers named in the
    registries. cors_origins empty means no CORS headers at all."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None  # a file whose stripped content is the key (keeps it out of ps)
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    max_n: int = 8  # choices per request
    # What one request may ask for (server/limits.py, checked before any tokenizer or engine
    # work). Each bounds work that grows with it: stop strings are matched on the engine thread
    # every step, tools and prompts are rendered and tokenized, logprobs decoded per token.
    max_stop_strings: int = 64  # OpenAI allows 4, vLLM any number
    max_stop_string_chars: int = 256  # characters in one stop string
    max_stop_token_ids: int = 256
    max_tools: int = 128  # OpenAI's own limit
    max_tools_chars: int = 256 << 10  # characters of all the tools' JSON (names, schemas)
    max_logprobs: int = 20  # top logprobs per token; SamplingParams computes at most 20
    max_prompt_chars: int = 2 << 20  # a prompt's or all messages' text, before tokenizing
    default_max_tokens: int | None = None  # when a request gives none; None: up to the context
    cors_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests, then aborts
    # A connection that has not sent a whole request line and headers this long after opening
    # (or after its last response) gets 408 and is closed: slow clients cannot hold sockets.
    header_timeout: float = 10.0
    # Open connections served at once; a request on one beyond them gets 503 and its connection
    # is closed. Below the open-file limit, which `outrider serve` raises to fit it.
    max_connections: int = 1000
    max_concurrent_requests: int | None = None  # POSTs in flight; beyond: 503. None: no cap
    served_model_name: str | None = None  # None: the checkpoint's file or directory name
    tool_parser: str | None = None  # e.g. "hermes", "kimi_k2" (see parsers/registry.py)
    reasoning_parser: str | None = None  # e.g. "think"
    chat_template: str | None = None  # a jinja file replacing the checkpoint's chat template
    # What one render of the chat template may cost (loaders/chat_template.py): wall time, and
    # characters written or built; past either, the request gets 400.
    chat_template_timeout_s: float = TemplateLimits.timeout_s
    chat_template_max_chars: int = TemplateLimits.max_chars
    # The least heartbeat silence of the engine thread that /health (503) and the systemd
    # watchdog (pings stop) call a stall; a model with slower steps raises it (async_engine.py).
    health_stall_s: float = 30.0
    # The engine core in a process of its own (server/engine_process.py), so that its host work
    # and the event loop's each have an interpreter; False: a thread of the server's process.
    engine_process: bool = True
    log_level: str = "warning"  # uvicorn's access and error log level
    metrics_prefix: str = "outrider"  # "vllm": /metrics as vllm:*, for vLLM's dashboards

    def __post_init__(self) -> None:
        check_types(self)  # a list of origins becomes a tuple
        if not 0 <= self.port <= 65535:
            raise ValueError(f"invalid port={self.port}: use 0..65535 (0 picks a free port)")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give api_key or api_key_file, not both: prefer api_key_file")
        if self.api_key == "":
            raise ValueError("invalid api_key='': use a non-empty key, or None for no auth")
        positive = ("max_body_bytes", "max_n", "shutdown_timeout", "health_stall_s",
                    "header_timeout", "max_connections", "chat_template_timeout_s",
                    "chat_template_max_chars", *REQUEST_LIMITS)  # fmt: skip
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: use a positive value")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(
                f"invalid max_logprobs={self.max_logprobs!r}: use 0..20 (the engine computes at "
                "most 20 top logprobs per token)"
            )
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(
                f"invalid max_concurrent_requests={self.max_concurrent_requests}: use an integer "
                ">= 1 or None (no cap)"
            )
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(
                f"invalid default_max_tokens={self.default_max_tokens}: use an integer >= 1 or None"
            )
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(
                f"invalid metrics_prefix={self.metrics_prefix!r}: use one of {METRICS_PREFIXES}"
            )
        from outrider.server.parsers.registry import REASONING_PARSERS, TOOL_PARSERS

        for name, value, known in (
            ("tool_parser", self.tool_parser, TOOL_PARSERS),
            ("reasoning_parser", self.reasoning_parser, REASONING_PARSERS),
        ):
            if value is not None and value not in known:
                raise ValueError(f"unknown {name}={value!r}: use one of {sorted(known)}, or None")

    def template_limits(self) -> TemplateLimits:
        return TemplateLimits(self.chat_template_timeout_s, self.chat_template_max_chars)

    def resolve_api_key(self) -> str | None:
        """The key requests must carry, read from api_key_file when that is set."""
        if self.api_key_file is None:
            return self.api_key
        path = Path(self.api_key_file)
        if not path.is_file():
            raise FileNotFoundError(
                f"api_key_file {str(path)!r} not found: create it (one line, the key) or drop it"
            )
        key = path.read_text().strip()
        if not key:
            raise ValueError(f"api_key_file {str(path)!r} is empty: write the key into it")
        return key

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def load_yaml(path: str | Path) -> tuple[ServerConfig, EngineConfig]:
    """Both configs from one YAML file; unknown sections and keys are errors, and every error
    names the file."""
    data = read_yaml(path)
    try:
        return _configs(data)
    except ValueError as e:
        raise ValueError(f"config file {str(path)!r}: {e}") from None


def _configs(data: dict[str, Any]) -> tuple[ServerConfig, EngineConfig]:
    server = data.pop("server", None) or {}
    if not isinstance(server, dict):
        raise ValueError(f"config section 'server' must be a mapping of keys, got {server!r}")
    server = dict(server)
    # Flat server keys, as vLLM's YAML has them (`port: 8000`, `tool-call-parser: hermes`).
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    for key in list(data):
        name = SERVER_ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name in names:
            if name in server and server[name] != data[key]:
                raise ValueError(
                    f"server.{name} is given twice, {server[name]!r} in the "
                    f"server section and {data[key]!r} as {key!r}: keep one"
                )
            server[name] = data.pop(key)
    engine = [*SECTIONS, *flat_names()]
    unknown = sorted(str(k) for k in data if str(k).replace("-", "_") not in engine)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown}{close_matches(unknown, [*engine, 'server', *names])}: "
            "use a section (server, model, cache, scheduler, speculative, parallel) or a field "
            "name, e.g. port or max_num_seqs"
        )
    return server_config_from_dict(server), EngineConfig.from_dict(data)


# vLLM's names of ServerConfig fields, in YAML and (as --tool-call-parser) on the command line
SERVER_ALIASES = {"tool_call_parser": "tool_parser"}


def server_config_from_dict(values: dict[str, Any]) -> ServerConfig:
    return build_section(ServerConfig, values, "server")
