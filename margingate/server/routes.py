"""The routes: /health, /metrics, /v1/models[/{id}], the generation routes (/v1/completions,
/v1/chat/completions, /v1/responses, /v1/messages: each its API's endpoint, completions.py, chat.py,
responses.py, messages.py) and
/tokenize, /detokenize (tokenization.py), /v1/embeddings (embeddings.py), and what a trainer calls
(control_routes.py: /v1/update_weights, /pause, /resume, /is_paused, /reset_prefix_cache).
Each handler finds the app's `ServerState` on `request.app.state.server`."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..options import PolicySpec
from .api import control_routes, embeddings, tokenization
from .api.chat import CHAT
from .api.completions import COMPLETIONS
from .api.messages import MESSAGES
from .api.responses import RESPONSES
from .core.metrics import CONTENT_TYPE
from .core.state import ServerState
from .protocol.errors import json_error

router = APIRouter()
router.include_router(tokenization.router)  # /tokenize, /detokenize
router.include_router(control_routes.router)  # /v1/update_weights, /pause, /resume, /is_paused, /reset_prefix_cache
router.include_router(embeddings.router)  # /v1/embeddings


def state_of(req: HTTPRequest) -> ServerState:
    return req.app.state.server


# --- plain routes ----------------------------------------------------------------------------

@router.get("/health")
async def health(req: HTTPRequest):
    state = state_of(req)
    w = state.worker
    status = "ok" if w.alive and w.accepting else "draining" if w.alive else "engine stopped"
    body = {"status": status, "model": state.model_id,
            "in_flight": w.in_flight, "running": w.running, "queued": w.queue_length,
            "kv_blocks_used": state.engine.load.blocks_used, "kv_blocks_free": state.engine.load.blocks_free,
            "last_error": w.last_error,
            # a trainer's updates since load (every response's determinism report names the one it ran under)
            "weight_version": state.engine.weight_version, "paused": w.paused is not None, "pause_mode": w.paused,
            "held": w.held,
            # the linear path in use, and any path this CPU has that failed its load-time proof
            "linear_path": state.environment.get("kernels_linear_path"),
            "linear_refused": state.environment.get("kernels_linear_refused", {}),
            # how quantized matrices compute: "int8" (the integer-exact contract), "exact" (bf16 bits), null
            "quantized_contract": state.environment.get("quantized_contract"),
            "int8_path": state.environment.get("kernels_int8_path")}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/metrics")
async def metrics(req: HTTPRequest):
    return Response(state_of(req).metrics.render(), media_type=CONTENT_TYPE)


def model_card(state: ServerState, model_id: str | None = None) -> dict:
    return {"id": model_id or state.model_id, "object": "model", "created": state.created, "owned_by": "margingate",
            "max_model_len": state.context.max_len, "determinism": {
                "default_policy": state.config.default_policy,
                "default_policy_resolved": PolicySpec(state.config.default_policy).resolve(state.context.device).name,
                "default_tau": state.context.default_tau,
                "tau_source": state.environment.get("tau_source")}}


@router.get("/v1/models")
async def models(req: HTTPRequest):
    state, served = state_of(req), getattr(req.app.state, "embeddings", None)  # embedding models: embeddings.py
    beside = [c for c in (served.cards() if served else []) if c["id"] not in state.model_names]
    return {"object": "list", "data": [model_card(state), *beside]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, req: HTTPRequest):
    state = state_of(req)
    if model_id not in state.model_names:
        return json_error(404, f"the model {model_id!r} does not exist; this server serves "
                               f"{state.model_id!r}", param="model", code="model_not_found")
    return model_card(state, model_id)


# --- generation: each API's endpoint over the serving core (endpoint.py) ------------------------------------

@router.post("/v1/completions")
async def completions(req: HTTPRequest):
    return await COMPLETIONS.serve(state_of(req), req)


@router.post("/v1/chat/completions")
async def chat_completions(req: HTTPRequest):
    return await CHAT.serve(state_of(req), req)


@router.post("/v1/responses")
async def create_response(req: HTTPRequest):
    return await RESPONSES.serve(state_of(req), req)


@router.post("/v1/messages")
async def create_message(req: HTTPRequest):
    return await MESSAGES.serve(state_of(req), req)
