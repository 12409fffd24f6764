"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a fitting status.

Everything the server refuses is an `APIError` raised where the problem is found; the app's
handlers turn it (and pydantic's, starlette's and any unexpected exception) into this JSON.
Bad input is always 4xx: only a broken engine answers 5xx. `param` names the field at fault
(pydantic's location, dotted: "messages.0.content") wherever there is one.

A message may quote what the client sent, but only through `clip()`, and `error_body` caps
every message besides: a 1 MB `model` must not come back as a 1 MB error.
"""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

from outrider.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI sends, with code "invalid_api_key"
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def to_dict(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status)


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict:
    info = ErrorInfo(
        message=_cap(message),
        type=_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
    )
    return ErrorResponse(error=info).model_dump()


ECHO_CHARS = 100  # a request value quoted in a message: this much of it, then its length
_MESSAGE_CHARS = 1000  # a whole message (quotes from code outside this package, exceptions)


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """repr(value) for a message, cut to its first `limit` characters plus the full length:
    clip("m" * 10**6) == "'mmm…m'… (1000000 characters)"."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters of repr)"


def clip_json(value: object, limit: int = ECHO_CHARS) -> str:
    """A value the client sent, as the JSON it sent, for a message; cut like clip():
    clip_json(True) == "true", clip_json("yes") == '"yes"'."""
    if isinstance(value, str) and len(value) > limit:
        return f"{json.dumps(value[:limit], ensure_ascii=False)}… ({len(value)} characters)"
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters of JSON)"


def _cap(message: str) -> str:
    """The last line against echoed input that did not pass through clip() (a message built
    in state.py or the engine, an exception's repr): keep the head and the tail, which says
    what to do."""
    if len(message) <= _MESSAGE_CHARS:
        return message
    head, tail = _MESSAGE_CHARS * 3 // 4, _MESSAGE_CHARS // 5
    cut = len(message) - head - tail
    return f"{message[:head]}… [{cut} characters cut] …{message[-tail:]}"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# pydantic puts a tag for the union member into an error's location ("str", "list[int]",
# "NamedToolChoice", "literal['none','auto']"): not a field. Fields here are snake_case.
_FIELD = re.compile(r"[a-z_][a-z0-9_]{0,63}\Z")
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})


def param_of(loc) -> str | None:
    """A pydantic error location as a dotted field path, union tags and "body" dropped:
    ("messages", 0, "content", "list[ContentPart]", 0, "type") -> "messages.0.content.0.type"."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (p != "body" and _FIELD.match(p) and p not in _UNION_TAGS)
    ]
    return ".".join(parts) or None


def from_validation_error(exc) -> APIError:
    """pydantic's ValidationError -> 400 naming the first bad field and what was wrong.

    A value that fits no member of a union gets one error per member; the deepest of them is
    reported (the member the client most likely meant: a content list whose part lacks `type`
    says so, not "Input should be a valid string"), or all of them where none is deeper."""
    try:
        errors = exc.errors(include_url=False)
    except TypeError:  # FastAPI's RequestValidationError.errors() takes no options
        errors = exc.errors()
    if not errors:
        return bad_request(str(exc))
    found = [(param_of(e.get("loc", ())) or "", str(e.get("msg"))) for e in errors]
    field = found[0][0].split(".")[0]
    same = [f for f in found if f[0].split(".")[0] == field]
    param = max((p for p, _ in same), key=lambda p: p.count("."))  # the first of the deepest
    msg = ", or ".join(dict.fromkeys(m for p, m in same if p == param))
    # The value at fault, unless it is missing (pydantic then gives the object around it).
    first = next(e for e, (p, _) in zip(errors, found) if p == param)
    shown = first.get("type") != "missing" and "input" in first
    got = f" (got {clip_json(first['input'])})" if shown else ""
    others = len({p.split(".")[0] for p, _ in found} - {field})
    more = f" (and problems in {others} more field(s))" if others else ""
    return bad_request(f"invalid {param or 'request'}: {msg}{got}{more}", param=param or None)
