"""ASGI guards that run before any route: the API key and the request body size.

Both are plain ASGI middleware so they act before FastAPI parses anything: an unauthenticated
or oversized request costs a header check, never a body read or a JSON parse.
"""

from __future__ import annotations

import hmac
import json

from outrider.server.errors import APIError, error_body

OPEN_PATHS = frozenset({"/health"})  # reachable without the key (load balancers, systemd)


async def _send_error(send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class APIKeyGuard:
    """Every HTTP request but OPEN_PATHS and CORS preflights must carry `Authorization: Bearer
    <key>`; the comparison takes constant time."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in OPEN_PATHS
            and scope["method"] != "OPTIONS"
        ):
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self._expected):
                reason = "no API key given" if not given else "the API key is not valid"
                await _send_error(
                    send,
                    401,
                    f"{reason}: send the server's key as 'Authorization: Bearer <key>' (the "
                    "openai client's api_key)",
                    code="invalid_api_key",
                )
                return
        await self.app(scope, receive, send)


class BodyLimitGuard:
    """Requests whose body exceeds max_bytes get 413: at once when Content-Length says so, else
    as soon as the streamed body passes the limit (the route's body read raises)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_error(send, 400, f"invalid Content-Length {declared!r}")
                return
            if size > self.max_bytes:
                await _send_error(send, 413, self._message(size))
                return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, self._message(seen))
            return message

        await self.app(scope, limited_receive, send)

    def _message(self, size: int) -> str:
        return (
            f"the request body has {size} bytes, more than this server accepts "
            f"({self.max_bytes}): send a shorter prompt, or raise max_body_bytes in the server config"
        )
