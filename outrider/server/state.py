"""ServerState: what every route needs, built once at start-up and read-only afterwards
(except `draining`, which only ever goes from False to True)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from outrider.loaders.chat_template import check_chat_template_syntax
from outrider.server.async_engine import AsyncEngine
from outrider.server.config import ServerConfig
from outrider.server.errors import APIError, clip
from outrider.server.metrics import ServerMetrics
from outrider.server.offload import Offload
from outrider.server.parsers.base import ReasoningParser, ToolParser
from outrider.server.parsers.registry import build_reasoning_parser, build_tool_parser


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    chat_tokenizer: object  # the engine's tokenizer, or a copy with config.chat_template
    tool_parser: ToolParser | None
    reasoning_parser: ReasoningParser | None
    offload: Offload
    draining: bool = False
    in_flight: int = 0  # POST requests between arrival and their last byte (event loop)

    @classmethod
    def build(cls, engine: AsyncEngine, config: ServerConfig, model_name: str) -> ServerState:
        template = origin = None
        if config.chat_template is not None:
            template, origin = read_chat_template(config.chat_template)
        # Tried on a one-message conversation here, so a broken template stops start-up.
        chat_tokenizer = engine.tokenizer.with_chat_template(
            config.template_limits(), template, origin
        )
        metrics = ServerMetrics(model_name, lambda: engine.stats, config.metrics_prefix)
        engine.observer = metrics
        return cls(
            engine=engine,
            config=config,
            model_name=model_name,
            metrics=metrics,
            chat_tokenizer=chat_tokenizer,
            tool_parser=build_tool_parser(config.tool_parser) if config.tool_parser else None,
            reasoning_parser=build_reasoning_parser(config.reasoning_parser)
            if config.reasoning_parser
            else None,
            offload=Offload(),
        )

    def check_admission(self) -> None:
        if self.draining:
            raise APIError(
                503, "the server is shutting down and takes no new requests: retry on another"
            )
        if not self.engine.is_alive:
            raise APIError(
                503, f"the engine has stopped ({self.engine.error!r}): restart the server"
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {clip(model)} does not exist here: this server serves "
                f"{self.model_name!r}"
                " (GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )


def read_chat_template(path: str) -> tuple[str, str]:
    """The text of the operator's chat template file and how errors name it; a file that is not
    there, or does not compile, is an error here (serve calls this before loading a model)."""
    origin = f"chat_template {path!r}"
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"{origin} not found: pass a jinja file, or drop the option to use the checkpoint's "
            "own template"
        )
    source = Path(path).read_text()
    try:
        check_chat_template_syntax(source)
    except ValueError as e:
        raise ValueError(f"{origin}: {e}") from None
    return source, origin
