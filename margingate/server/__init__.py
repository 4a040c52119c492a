"""OpenAI-compatible HTTP server: one engine thread, per-request determinism, SSE streaming, metrics.

    from margingate.llm import LLM
    from margingate.server import create_app
    app = create_app(LLM(max_num_seqs=16))      # serve with uvicorn

or `margingate serve` from the command line. Needs the `server` extra (fastapi, uvicorn).

Rooms: `app.py` + `routes.py` + `guard.py` (the app, its routes, the key check) and `background.py` (uvicorn)
over `api/` (one endpoint per API), `core/` (bodies into engine requests, the engine thread, events into
answers), `parsers/` (an answer's text into content, reasoning and tool calls) and `protocol/` (the wire's
shapes). Arrows point one way: app -> api -> core -> parsers, protocol (docs/architecture.md).
"""
from __future__ import annotations

__all__ = ["BackgroundServer", "ServerConfig", "create_app"]


def __getattr__(name):  # lazy: importing margingate.server must not need fastapi
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "ServerConfig":
        from .core.config import ServerConfig

        return ServerConfig
    if name == "BackgroundServer":
        from .background import BackgroundServer

        return BackgroundServer
    raise AttributeError(name)
