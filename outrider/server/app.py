"""The FastAPI app: routes, guards and error handlers around one ServerState.

    GET  /health               200 while the engine thread makes progress, else 503 (HEAD too)
    GET  /metrics              Prometheus text
    GET  /v1/models            the served model
    POST /v1/chat/completions  serving_chat.py
    POST /v1/completions       serving_completion.py
    POST /tokenize             a prompt or messages -> token ids (serving_tokens.py, as vLLM's)
    POST /detokenize           token ids -> text
    GET  /version              {"version": ...}

Every route but /health needs the API key when one is configured. Every error, whatever
raised it, leaves as OpenAI's error JSON; a 404 lists the routes above, and for an OpenAI
endpoint outrider leaves out (/v1/embeddings, /v1/responses, /v1/audio/...) says so.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from outrider.server import serving_tokens
from outrider.server.errors import APIError, clip, error_body, from_validation_error
from outrider.server.guards import APIKeyGuard, BodyLimitGuard, InFlightGuard
from outrider.server.metrics import CONTENT_TYPE
from outrider.server.protocol import ModelCard, ModelList
from outrider.server.serving_chat import create_chat_completion
from outrider.server.serving_completion import create_completion
from outrider.server.state import ServerState

log = logging.getLogger(__name__)

# OpenAI endpoints outrider does not implement. A client pointed at one is told so plainly,
# rather than with a 404 that reads as if the model were missing.
_UNSERVED_OPENAI = (
    "/v1/embeddings",
    "/v1/responses",
    "/v1/moderations",
    "/v1/audio/",
    "/v1/images/",
    "/v1/files",
    "/v1/batches",
    "/v1/fine_tuning/",
    "/v1/assistants",
    "/v1/threads",
    "/v1/vector_stores",
    "/v1/uploads",
    "/v1/realtime",
)


def build_app(state: ServerState, api_key: str | None) -> FastAPI:
    app = FastAPI(title="outrider", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _add_routes(app, state)
    _add_error_handlers(app)
    # Starlette runs the middleware added last first: CORS, the key, the body cap, the count.
    app.add_middleware(InFlightGuard, state=state)
    app.add_middleware(BodyLimitGuard, max_bytes=state.config.max_body_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyGuard, api_key=api_key)
    if state.config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    # HEAD too: load balancers and uptime checks probe with it.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        engine = state.engine
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_alive:
            return JSONResponse({"status": "engine stopped", "error": repr(engine.error)}, 503)
        # Never waits on the engine: reads the heartbeat its thread stores every loop turn and
        # before every decoder layer, so a long step is slow, not stalled (async_engine.py).
        now = time.monotonic()
        age, limit = now - engine.heartbeat.last, engine.heartbeat.limit_s
        body = {
            "heartbeat_age_s": round(age, 3),
            "stall_limit_s": round(limit, 3),
            "last_step_age_s": round(now - engine.last_step_time, 3),
        }
        if age > limit:  # stuck, with or without requests: restart it
            return JSONResponse({"status": "stalled", **body}, 503)
        return JSONResponse({"status": "ok", **body})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=state.model_name, max_model_len=state.engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await create_chat_completion(state, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving_tokens.tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving_tokens.detokenize(state, request)

    @app.get("/version")
    async def version() -> JSONResponse:
        return serving_tokens.version()


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = _not_found(app, request.method, request.url.path)
        return JSONResponse(
            error_body(exc.status_code, message), exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {exc!r}"), 500)


def _not_found(app: FastAPI, method: str, path: str) -> str:
    """The 404 message: whether `path` is an OpenAI endpoint outrider leaves out, or no route
    at all, then every route the app serves (read from the app, so it cannot go stale)."""
    routes = ", ".join(
        f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}"
        for r in app.routes
        if isinstance(r, APIRoute)
    )
    bare = path.rstrip("/")
    if any(bare == p.rstrip("/") or path.startswith(p) for p in _UNSERVED_OPENAI):
        return (
            f"outrider does not serve {method} {clip(path)}, an OpenAI endpoint it does not"
            f" implement; it serves {routes}"
        )
    return f"no route {method} {clip(path)}; outrider serves {routes}"
