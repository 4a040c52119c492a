"""The routes: /health, /metrics, /v1/models[/{id}], /v1/completions, /v1/chat/completions,
/v1/responses (responses.py: served as chat) and /tokenize, /detokenize (tokenization.py).
Each handler finds the app's `ServerState` on `request.app.state.server`."""
from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..options import PolicySpec
from . import responses, sdk_fields, tokenization
from .errors import QueueFull, ShuttingDown, json_error
from .events import Handle
from .jobs import Api, Job, abort_all, complete, next_event
from .metrics import CONTENT_TYPE
from .parsing import parse_job
from .protocol import BadRequest
from .state import ServerState
from .streaming import EventStream, stream

router = APIRouter()
router.include_router(tokenization.router)  # /tokenize, /detokenize
log = logging.getLogger("margingate.server")
COMPLETIONS = Api(parse_job, None, stream)  # /v1/completions and /v1/chat/completions


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


def model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "margingate",
            "max_model_len": state.engine.max_len, "determinism": {
                "default_policy": state.config.default_policy,
                "default_policy_resolved": PolicySpec(state.config.default_policy).resolve(state.llm.device).name,
                "default_tau": state.llm.default_tau,
                "tau_source": state.environment.get("tau_source")}}


@router.get("/v1/models")
async def models(req: HTTPRequest):
    return {"object": "list", "data": [model_card(state_of(req))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, req: HTTPRequest):
    state = state_of(req)
    if model_id != state.model_id:
        return json_error(404, f"the model {model_id!r} does not exist; this server serves "
                               f"{state.model_id!r}", param="model", code="model_not_found")
    return model_card(state)


# --- generation --------------------------------------------------------------------------------

@router.post("/v1/completions")
async def completions(req: HTTPRequest):
    return await generate(state_of(req), req, "completion")


@router.post("/v1/chat/completions")
async def chat_completions(req: HTTPRequest):
    return await generate(state_of(req), req, "chat")


@router.post("/v1/responses")
async def create_response(req: HTTPRequest):
    return await generate(state_of(req), req, "chat", responses.API)


async def generate(state: ServerState, req: HTTPRequest, kind: str, api: Api = COMPLETIONS) -> Response:
    try:
        job = await api.parse(state, req, kind)
    except BadRequest as exc:
        state.metrics.inc("requests_rejected_total", reason="invalid" if exc.status < 500 else "error")
        return json_error(exc.status, exc.message, param=exc.param, code=exc.code)
    handles = submit(state, job)
    response = handles if isinstance(handles, Response) else await answer(state, job, handles, req, api)
    ignored = job.ignored
    if ignored:  # said, not refused: the client learns what had no effect
        log.info("%s: ignored unknown fields: %s", job.id, ", ".join(ignored))
        response.headers[sdk_fields.IGNORED_HEADER] = sdk_fields.header_value(ignored)
    return response


def submit(state: ServerState, job: Job) -> list[Handle] | Response:
    """Every choice handed to the engine thread, or the 429 / 503 that refuses the request (none runs)."""
    retry = {"Retry-After": str(state.config.retry_after_s)}
    handles: list[Handle] = []
    try:
        for choice in job.choices:
            handles.append(state.worker.submit(choice.request))
        return handles
    except QueueFull as exc:
        abort_all(state, handles, "aborted")
        state.metrics.inc("requests_rejected_total", reason="queue_full")
        return json_error(429, f"server busy: {exc}; retry later", code="queue_full", headers=retry)
    except ShuttingDown as exc:
        abort_all(state, handles, "aborted")
        state.metrics.inc("requests_rejected_total", reason="unavailable")
        return json_error(503, str(exc), code="unavailable", headers=retry)


async def answer(state: ServerState, job: Job, handles: list[Handle], req: HTTPRequest, api: Api) -> Response:
    """Once the engine took the requests: a stream or the whole answer. Until one of them owns the
    requests, any way out (the engine's refusal, a cancelled handler) aborts them."""
    handed_over = False
    try:
        for handle in handles:
            event = await next_event(handle)  # "accepted", or the engine refused it
            if event.kind == "error":
                param = api.prompt_param or ("messages" if job.kind == "chat" else "prompt")
                return json_error(event.status, event.message, param=param,
                                  code="engine_error" if event.status >= 500 else "invalid_request")
        handed_over = True
        if job.params.streaming:
            return EventStream(state.worker, handles, api.stream(state, job, handles))
        return await complete(state, job, handles, req, api.render)
    finally:
        if not handed_over:
            abort_all(state, handles, "disconnect")
