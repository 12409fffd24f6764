"""Guards that run before any route: the API key and the request body size (ASGI), and
requests that are not valid HTTP (uvicorn's protocol).

The first two are plain ASGI middleware so they act before FastAPI parses anything: an
unauthenticated or oversized request costs a header check, never a body read or a JSON parse.
"""

from __future__ import annotations

import hmac
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from outrider.server.errors import APIError, clip, error_body

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


def _headers(scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", ()) if key.lower() == name]


class APIKeyGuard:
    """Every HTTP request but OPEN_PATHS and CORS preflights must carry `Authorization: Bearer
    <key>`, the scheme in any case (RFC 7235: "bearer" is the same scheme); the key comparison
    takes constant time."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in OPEN_PATHS
            and scope["method"] != "OPTIONS"
        ):
            given = _header(scope, b"authorization") or b""
            scheme, _, token = given.partition(b" ")
            bearer = scheme.lower() == b"bearer"
            # compare_digest even for a wrong scheme: the time taken says nothing about the key.
            if not (hmac.compare_digest(token.strip(b" "), self._key) and bearer):
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
        declared = {v.strip(b" \t") for v in _headers(scope, b"content-length")}
        if declared:
            # Digits only, one value: int() alone would take "-1", "+5", "1_000" and " 5".
            value = declared.pop()
            if declared or not value.isdigit():
                given = b", ".join([value, *sorted(declared)]).decode("latin-1")
                await _send_error(
                    send,
                    400,
                    f"invalid Content-Length {clip(given)}: it must be one non-negative integer, "
                    "the body's size in bytes (or leave the header out and let the client set it)",
                )
                return
            # int() refuses 4,300+ digits; 19 already exceed any body this server reads.
            size = int(value) if len(value) <= 18 else None
            if size is None or size > self.max_bytes:
                shown = f"a {len(value)}-digit number of" if size is None else size
                await _send_error(send, 413, self._message(shown))
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

    def _message(self, size: int | str) -> str:
        return (
            f"the request body has {size} bytes, more than this server accepts "
            f"({self.max_bytes}): send a shorter prompt, or raise max_body_bytes in the server config"
        )


class JSONErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse (a Content-Length of "-1" or
    "abc", a malformed header or request line) with the error JSON instead of plain text. Such
    a request never reaches the app, so no ASGI guard can: pass uvicorn.Config(http=this)."""

    def send_400_response(self, msg: str) -> None:  # uvicorn's hook for h11's protocol errors
        body = json.dumps(
            error_body(
                400,
                "the request is not valid HTTP/1.1 (a malformed request line or header, such as "
                "a Content-Length that is not one non-negative integer): fix the client",
            )
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()
