"""The app that serves embedding models alone (`margingate serve --model all-minilm-l6-v2`): /v1/embeddings
(api/embeddings.py), /v1/models and /health, behind the same Guard as the chat app."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from .api.embeddings import EmbeddingModels, router
from .core.config import ServerConfig
from .core.metrics import Metrics
from .guard import Guard
from .protocol.errors import json_error

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


@dataclass
class _GuardState:  # what Guard reads: the API key, and the counters it increments
    config: ServerConfig
    metrics: Metrics


def create_embedding_app(models: EmbeddingModels, config: ServerConfig | None = None) -> FastAPI:
    """An app that serves embedding models alone: /v1/embeddings, /v1/models[/{id}], /health; generation
    routes answer 400 naming what this server is. The API key (config.api_key) guards every route but /health."""
    config = config or ServerConfig()
    app = FastAPI(title="margingate embeddings", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.embeddings = models
    app.include_router(router)

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(models.embedders)}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        card = next((c for c in models.cards() if c["id"] == model_id), None)
        return card or json_error(404, f"the model {model_id!r} does not exist", param="model",
                                  code="model_not_found")

    async def embeddings_only():
        return json_error(400, f"this server serves embedding models only ({', '.join(models.embedders)}): "
                               "POST /v1/embeddings; serve a chat model with `margingate serve --model NAME`",
                          param="model", code="embedding_model")

    for route in GENERATION_ROUTES:
        app.add_api_route(route, embeddings_only, methods=["POST"])
    app.add_middleware(Guard, state=_GuardState(config, Metrics()))
    return app
