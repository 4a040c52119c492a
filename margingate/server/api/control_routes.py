"""The routes of control.py, a trainer's calls (vLLM's names): POST /v1/update_weights {"path", "mode"},
POST /pause?mode=abort|wait|keep, POST /resume, GET /is_paused, POST /reset_prefix_cache. Each answers with the
pause's state and the weight version; a bad body or mode is a 400 naming the field, weights that do not fit the
model a 400 naming the tensor (nothing changed), a conflict (resumed during an update) a 409."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool

from ...serving_context import WeightsError
from ..core.control import Control
from ..core.parsing import json_object, read_body
from ..core.pause import PAUSE_MODES
from ..protocol.common import BadRequest, validation_message
from ..protocol.errors import json_error

router = APIRouter()


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str
    mode: Literal["abort", "wait", "keep"] = "wait"


def control_of(req: HTTPRequest) -> Control:
    return req.app.state.server.control


def mode_error(mode: str):
    return json_error(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param="mode")


@router.post("/v1/update_weights")
async def update_weights(req: HTTPRequest):
    state = req.app.state.server
    try:
        body = UpdateWeightsBody.model_validate(json_object(await read_body(req, state.config.max_body_bytes)))
    except BadRequest as exc:
        return json_error(exc.status, exc.message, param=exc.param, code=exc.code)
    except ValidationError as exc:
        message, param = validation_message(exc)
        return json_error(400, message, param=param)
    try:
        version = await run_in_threadpool(state.control.update_weights, body.path, body.mode)
    except WeightsError as exc:  # read and checked before anything paused: nothing changed
        return json_error(400, str(exc), param="path", code="invalid_weights")
    except RuntimeError as exc:
        return json_error(409, str(exc), code="conflict")
    return {**state.control.status(), "weight_version": version}


@router.post("/pause")
async def pause(req: HTTPRequest, mode: str = "abort"):
    if mode not in PAUSE_MODES:
        return mode_error(mode)
    return await run_in_threadpool(control_of(req).pause, mode)


@router.post("/resume")
async def resume(req: HTTPRequest):
    return await run_in_threadpool(control_of(req).resume)


@router.get("/is_paused")
async def is_paused(req: HTTPRequest):
    return {"is_paused": control_of(req).status()["paused"]}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(req: HTTPRequest):
    return {"blocks_dropped": await run_in_threadpool(control_of(req).reset_prefix_cache)}
