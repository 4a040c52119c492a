"""The FastAPI app: OpenAI-compatible routes in front of one engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /v1/messages (Anthropic's),
GET /v1/models, GET /health, GET /metrics. With an API key every route but /health needs
`Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients send it).

Per-request determinism: `"deterministic": true` runs the request under the
server's default deterministic policy (`auto`: the cheapest guaranteed one for the device);
`"determinism": {...}` picks the policy and its options. Without either the
request runs on the fast path (policy `fast`: reproducible alone, not across
batches). The response's `determinism` object is the policy's report for this
request (triggers, repairs, rollbacks, ...) plus the environment the contract
depends on.

The parts, by room (margingate/server/__init__.py): api/ (endpoint.py, one API's endpoint: parse, submit, answer
whole or streamed, and its subclasses completions.py, chat.py, responses.py + responses_request.py and messages.py
+ messages_request.py, the last two served as chat), core/ (config.py, the settings; state.py, what one app holds:
the serving context, margingate/serving_context.py, with the engine built whole; parsing.py, the core's recipe: a
validated body -> Job; jobs.py, events -> answer; worker.py, the engine thread, and events.py, its typed
per-request events; streaming.py, SSE, the text and its stop strings the engine's: engine/detokenize.py;
metrics.py; heap.py, the C heap's free pages handed back once idle), parsers/ (answer.py + call_parser.py +
call_shapes.py + reasoning.py: an answer's text read into content, reasoning and tool calls as it is released),
protocol/ (common.py, bodies.py, errors.py, ...); beside this module routes.py and guard.py (API key, request
counts).
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import Engine
from ..serving_context import ServingContext
from .api.embeddings import EmbeddingModels
from .core.config import ServerConfig
from .core.state import ServerState
from .guard import Guard
from .protocol.errors import route_error
from .protocol.sdk_fields import IGNORED_HEADER
from .routes import router

log = logging.getLogger("margingate.server")


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine thread runs while the app does; on shutdown in-flight requests get the grace."""
    state: ServerState = app.state.server
    state.worker.start()
    try:
        yield
    finally:
        await run_in_threadpool(state.worker.shutdown, state.config.shutdown_grace_s)


async def http_error(req, exc: StarletteHTTPException):
    return route_error(req.url.path, exc.status_code, str(exc.detail),
                       code="not_found" if exc.status_code == 404 else None, headers=getattr(exc, "headers", None))


async def internal_error(req, exc: Exception):
    log.exception("unhandled error")
    return route_error(req.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")


def create_app(served, config: ServerConfig | None = None, *, engine: Engine | None = None,
               embeddings: EmbeddingModels | None = None, **settings) -> FastAPI:
    """An app serving `served`: a `ServingContext`, or the facade whose model it gathers (`ServingContext.of`:
    its tokenizer, policies and, unless `engine` is given, its engine).

    `config` (or `ServerConfig` fields as keywords: api_key, max_queue, default_policy, ...)
    says how; see server/core/config.py for the defaults. `embeddings`: the embedding models /v1/embeddings
    serves beside the chat model (api/embeddings.py).
    """
    config = replace(config or ServerConfig(), **settings)
    context = served if isinstance(served, ServingContext) else ServingContext.of(served, engine)
    context.policy(config.default_policy)  # refuse a bad default up front
    state = ServerState(context, config)
    app = FastAPI(title="margingate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.embeddings = embeddings
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(router)
    app.add_middleware(Guard, state=state)
    if config.cors_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=[IGNORED_HEADER])
    return app
