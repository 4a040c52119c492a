"""ASGI middleware in front of every route: the API key, and request counts by route and status."""
from __future__ import annotations

import hmac

from .core.state import ServerState
from .protocol.errors import route_error

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health",
          "/v1/embeddings", "/metrics", "/tokenize", "/detokenize", "/v1/update_weights", "/pause", "/resume",
          "/is_paused", "/reset_prefix_cache")


def route_label(path: str) -> str:
    """The metrics label for a path: a known route, the model route, or "other" (bounded cardinality)."""
    return path if path in ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")


class Guard:
    """ASGI middleware: API-key check (all routes but /health; `Authorization: Bearer <key>`, or `x-api-key: <key>`
    as Anthropic's clients send it) and per-route request counts."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._key = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = route_label(path)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self._expected is not None and path != "/health":
                headers = dict(scope.get("headers") or [])
                if not (hmac.compare_digest(headers.get(b"authorization", b""), self._expected)
                        or hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)):
                    response = route_error(path, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                    return await response(scope, receive, send_wrapper)
            await self.app(scope, receive, send_wrapper)
        finally:
            self.state.metrics.inc("http_requests_total", route=route, code=str(status["code"]))
