"""Error answers: the OpenAI error body as a JSON response; the engine thread's refusals (queue full, shutting
down) and a request the engine failed."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from .protocol import error_body


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
