"""Error answers: the OpenAI error body as a JSON response, and Anthropic's on its route (/v1/messages), so
each API's clients read their own; the engine thread's refusals (queue full, shutting down) and a request the
engine failed."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from .common import error_body


class QueueFull(Exception):
    """Too many requests in flight: the caller should retry later (429)."""


class ShuttingDown(Exception):
    """The server is draining: no new requests (503)."""


class RequestFailed(Exception):
    """The engine failed a request it had accepted (an `error` event: events.py)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def json_error(status: int, message: str, *, param: str | None = None, code: str | None = None,
               headers: dict | None = None) -> JSONResponse:
    type_ = ("invalid_request_error" if status < 500 else "server_error")
    if status == 401:
        type_ = "authentication_error"
    elif status == 429:
        type_ = "rate_limit_error"
    elif status == 503:
        type_ = "service_unavailable"
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


# Anthropic's error type for each status it answers with; any other 4xx is an invalid_request_error, a 5xx an
# api_error. Its overloaded_error comes with 529; a draining server here answers 503, with that type.
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_ROUTES = frozenset({"/v1/messages"})


def anthropic_error(status: int, message: str, *, param: str | None = None,
                    headers: dict | None = None) -> JSONResponse:
    """Anthropic's error body, `{"type": "error", "error": {"type", "message"}}`; `param` (the field a refusal
    names, as on the other routes) beside them where there is one."""
    error = {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error"),
             "message": message}
    if param is not None:
        error["param"] = param
    return JSONResponse({"type": "error", "error": error}, status_code=status, headers=headers)


def route_error(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None,
                headers: dict | None = None) -> JSONResponse:
    """An error answer in the shape of the API `path` serves: Anthropic's on its route, OpenAI's elsewhere."""
    if path in ANTHROPIC_ROUTES:
        return anthropic_error(status, message, param=param, headers=headers)
    return json_error(status, message, param=param, code=code, headers=headers)
