"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a fitting status.

Everything the server refuses is an `APIError` raised where the problem is found; the app's
handlers turn it (and pydantic's, starlette's and any unexpected exception) into this JSON.
Bad input is always 4xx: only a broken engine answers 5xx.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from outrider.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI sends, with code "invalid_api_key"
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
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
        message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code
    )
    return ErrorResponse(error=info).model_dump()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_validation_error(exc) -> APIError:
    """pydantic's ValidationError -> 400 naming the first bad field and what was wrong."""
    try:
        errors = exc.errors(include_url=False, include_input=False)
    except TypeError:  # FastAPI's RequestValidationError.errors() takes no options
        errors = exc.errors()
    if not errors:
        return bad_request(str(exc))
    first = errors[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad_request(f"invalid {param or 'request'}: {first.get('msg')}{more}", param=param)
