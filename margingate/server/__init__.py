"""OpenAI-compatible HTTP server: one engine thread, per-request determinism, SSE streaming, metrics.

    from margingate.llm import LLM
    from margingate.server import create_app
    app = create_app(LLM(max_num_seqs=16))      # serve with uvicorn

or `margingate serve` from the command line. Needs the `server` extra (fastapi, uvicorn).
"""
from __future__ import annotations

__all__ = ["create_app"]


def __getattr__(name):  # lazy: importing margingate.server must not need fastapi
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
