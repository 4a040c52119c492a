"""A generation request once accepted: the worker's per-request events turned into text deltas and a
final result, the response's envelope, usage and determinism report, and the non-streaming answer."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..engine import Request, Result
from ..engine.policy import Policy
from .errors import RequestFailed, json_error
from .protocol import OPENAI_FINISH, finite
from .state import ServerState
from .text import TextAssembler
from .worker import Handle


@dataclass
class Job:
    """One generation request, parsed and validated."""
    kind: str                      # "completion" or "chat"
    params: Any
    request: Request
    policy: Policy
    deterministic: bool
    id: str


# --- response pieces ---------------------------------------------------------------------

NOT_GUARANTEED = ("strict is off: tokens were released before the verifier saw them and a flip it finds later "
                  "is not taken back, so this output may differ from the same request alone")


def determinism_report(state: ServerState, job: Job, result: Result) -> dict:
    req = job.request
    guaranteed = job.policy.deterministic  # with these options (a non-strict margin is not)
    return finite({
        "deterministic": job.deterministic,
        "batch_invariant": guaranteed,
        "guaranteed": job.deterministic and guaranteed,
        **({"warning": NOT_GUARANTEED} if job.deterministic and not guaranteed else {}),
        **result.stats,
        "temperature": req.temperature,
        "seed": req.seed if req.temperature > 0 else None,
        "engine_finish_reason": result.finish_reason,
        "environment": state.environment,
    })


def envelope(state: ServerState, job: Job) -> dict:
    return {"id": job.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": state.model_id, "system_fingerprint": state.fingerprint}


def usage(job: Job, completion_tokens: int, result: Result | None = None) -> dict:
    n = len(job.request.prompt_ids)
    out = {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}
    if result is not None:  # as OpenAI reports it: prompt positions served from the prefix cache
        out["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    return out


# --- the worker's events -> deltas ---------------------------------------------------------

async def next_event(handle: Handle) -> tuple[str, Any]:
    return await handle.events.get()


async def run_job(state: ServerState, handle: Handle, assembler: TextAssembler) -> AsyncIterator[tuple]:
    """Yields ("delta", text, ids) then ("final", finish_reason, result); raises RequestFailed."""
    pending_ids: list[int] = []
    while True:
        kind, payload = await next_event(handle)
        if kind == "error":
            raise RequestFailed(*payload)
        if kind == "tokens":
            if assembler.stopped:
                continue
            before = len(assembler.ids)
            text = assembler.feed(payload)
            pending_ids += assembler.ids[before:]
            if assembler.stopped:
                state.worker.abort(handle, "stop")
            if text or assembler.stopped:
                yield ("delta", text, pending_ids)
                pending_ids = []
        elif kind == "done":
            result: Result = payload
            text = assembler.flush()
            if text or pending_ids:
                yield ("delta", text, pending_ids)
            reason = "stop" if assembler.stopped else OPENAI_FINISH.get(result.finish_reason, "stop")
            yield ("final", reason, result)
            return


# --- the non-streaming answer ----------------------------------------------------------------

async def wait_disconnect(req: HTTPRequest) -> None:
    while True:
        message = await req.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(state: ServerState, job: Job, handle: Handle) -> tuple[str, list[int], tuple]:
    """The whole answer: (text, token ids, ("final", finish_reason, result))."""
    assembler = TextAssembler(state.decode, job.params.stop_strings)
    parts, ids, final = [], [], None
    async for ev in run_job(state, handle, assembler):
        if ev[0] == "delta":
            parts.append(ev[1])
            ids += ev[2]
        else:
            final = ev
    return "".join(parts), ids, final


async def complete(state: ServerState, job: Job, handle: Handle, req: HTTPRequest) -> Response:
    """Runs the request to its end, or aborts it (freeing its KV slot) when the client goes away."""
    task = asyncio.ensure_future(collect(state, job, handle))
    gone = asyncio.ensure_future(wait_disconnect(req))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            state.worker.abort(handle, "disconnect")
        gone.cancel()
    if task not in done:
        return Response(status_code=499)  # nobody is listening
    try:
        text, ids, (_, reason, result) = task.result()
    except RequestFailed as exc:
        return json_error(exc.status, exc.message, code="engine_error" if exc.status >= 500 else None)
    return JSONResponse(completion_body(state, job, text, ids, reason, result))


def completion_body(state: ServerState, job: Job, text: str, ids: list[int], reason: str, result: Result) -> dict:
    body = envelope(state, job)
    choice = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": ids}
    if job.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body.update(choices=[choice], usage=usage(job, len(ids), result),
                determinism=determinism_report(state, job, result))
    return body
