"""vLLM's /tokenize and /detokenize, in its shapes: a client counts a prompt's tokens, or reads ids back
as text, with this model's tokenizer and chat template.

POST /tokenize {"prompt": text, "add_special_tokens": true} or a chat body ({"messages", "tools",
"add_generation_prompt", "chat_template_kwargs", ...}: the prompt /v1/chat/completions would build for
it, tool offer included), "return_token_strs" optional -> {"count", "max_model_len", "tokens",
"token_strs"}. POST /detokenize {"tokens": [ids]} -> {"prompt": text}.
"""
from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from ...data.prompts import Prompt
from ..core.parsing import json_object, read_body, validate
from ..core.state import ServerState
from ..protocol.common import BadRequest
from ..protocol.errors import json_error
from .chat import CHAT

router = APIRouter()


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.pop(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean", param=name)
    return value


async def _ids(state: ServerState, body: dict) -> list[int]:
    """The token ids of a tokenize body: a chat's prompt, or a text."""
    special = _flag(body, "add_special_tokens", "messages" not in body)  # a template writes its own
    if "messages" in body:
        params = validate(state, body, CHAT.body)
        plan = await run_in_threadpool(CHAT.tool_plan, state, params)
        return (await CHAT.prompts(state, params, plan))[0][0]
    text = body.pop("prompt", None)
    if not isinstance(text, str) or set(body) - {"model"}:
        raise BadRequest("tokenize takes {\"prompt\": text} or a chat body with \"messages\"", param="prompt")
    if special:
        return await run_in_threadpool(state.context.encode_prompt, Prompt("text", None, text, "http"))
    return state.context.encode(text)


@router.post("/tokenize")
async def tokenize(req: HTTPRequest):
    state: ServerState = req.app.state.server
    try:
        body = json_object(await read_body(req, state.config.max_body_bytes))
        strs = _flag(body, "return_token_strs", False)
        ids = await _ids(state, body)
    except BadRequest as exc:
        return json_error(exc.status, exc.message, param=exc.param, code=exc.code)
    return {"count": len(ids), "max_model_len": state.context.max_len, "tokens": ids,
            "token_strs": [state.formatter.text(t) for t in ids] if strs else None}


@router.post("/detokenize")
async def detokenize(req: HTTPRequest):
    state: ServerState = req.app.state.server
    try:
        body = json_object(await read_body(req, state.config.max_body_bytes))
        ids, vocab = body.get("tokens"), state.context.vocab_size
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise BadRequest(f"tokens must be a list of token ids in 0..{vocab - 1}", param="tokens")
    except BadRequest as exc:
        return json_error(exc.status, exc.message, param=exc.param, code=exc.code)
    return {"prompt": state.context.decode(ids)}
