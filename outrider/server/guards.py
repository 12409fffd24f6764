"""Guards that run before any route: the API key, the request body size and the requests in
flight (ASGI), and what only uvicorn's protocol sees: requests that are not valid HTTP,
connections that never finish their request head, and connections beyond the cap.

The ASGI guards act before FastAPI parses anything: an unauthenticated or oversized request
costs a header check, never a body read or a JSON parse.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import TYPE_CHECKING

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from outrider.server.errors import APIError, clip, error_body

if TYPE_CHECKING:
    from outrider.server.state import ServerState

OPEN_PATHS = frozenset({"/health"})  # reachable without the key (load balancers, systemd)
_DRAIN_POLL_S = 0.25  # how often a request waiting for its body looks for a shutdown


async def _send_error(
    send, status: int, message: str, code: str | None = None, close: bool = False
) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
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


class InFlightGuard:
    """Counts POST requests from arrival until their response's last byte (a stream's ASGI call
    returns only when the stream ends): what a graceful shutdown waits for. Beyond the server's
    max_concurrent_requests a request gets 503 at once. Once the server drains, a request still
    waiting for its body gets 503 too, within _DRAIN_POLL_S: it would be refused on arrival
    anyway, and an upload may not finish before the process must exit."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        cap = self.state.config.max_concurrent_requests
        if cap is not None and self.state.in_flight >= cap:
            await _send_error(
                send,
                503,
                f"the server has {self.state.in_flight} requests in flight, as many as it takes "
                "(max_concurrent_requests): retry shortly, or raise max_concurrent_requests",
            )
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, self._body_unless_draining(receive), send)
        finally:
            self.state.in_flight -= 1

    def _body_unless_draining(self, receive):
        body_done = False

        async def receive_body():
            nonlocal body_done
            while not body_done:
                if self.state.draining:
                    raise APIError(
                        503,
                        "the server is shutting down and takes no new requests: retry on another",
                    )
                try:  # cancelling uvicorn's receive() while it waits loses no message
                    message = await asyncio.wait_for(receive(), _DRAIN_POLL_S)
                except TimeoutError:
                    continue
                body_done = message["type"] != "http.request" or not message.get("more_body")
                return message
            return await receive()  # after the body: only the client's going away is left

        return receive_body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with what no ASGI guard can do, as these requests never reach
    the app (pass uvicorn.Config(http=functools.partial(GuardedH11Protocol, header_timeout=...,
    max_connections=...))):

    - a request it cannot parse (a Content-Length of "-1" or "abc", a malformed header or
      request line) is answered with the error JSON instead of plain text;
    - a connection that has not sent a whole request head within `header_timeout` seconds of
      opening or of its last response is closed, with a 408 when it had begun one: a client
      sending headers a byte at a time cannot hold a socket for ever;
    - a request on a connection beyond `max_connections` open ones (all but /health) gets 503
      and its connection closes.
    """

    def __init__(
        self,
        config,
        server_state,
        app_state,
        _loop=None,
        *,
        header_timeout: float,
        max_connections: int,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timeout, self.max_connections = header_timeout, max_connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._app, self.app = self.app, self._admit

    async def _admit(self, scope, receive, send) -> None:
        if len(self.connections) > self.max_connections and scope.get("path") not in OPEN_PATHS:
            await _send_error(
                send,
                503,
                f"the server has {len(self.connections)} connections open, more than it serves "
                f"({self.max_connections}): retry shortly, or raise max_connections",
                close=True,
            )
            return
        await self._app(scope, receive, send)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in: the body has its own limit
            self._stop_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request at once
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()

    def _await_head(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        begun, _ = self.conn.trailing_data
        if begun:  # h11 has no request to answer: the response goes out as bytes
            self.transport.write(
                _response_bytes(
                    408,
                    b"Request Timeout",
                    f"the request line and headers did not arrive within {self.header_timeout:g} "
                    "s: send them whole",
                )
            )
        self.transport.close()

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


def _response_bytes(status: int, reason: bytes, message: str) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    return head % (status, reason, len(body)) + b"connection: close\r\n\r\n" + body
