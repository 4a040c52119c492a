"""The streaming answer: server-sent events, one chunk per released delta, the final chunk with the
determinism report (and usage), `data: [DONE]`; a client gone mid-stream frees its KV slot at once."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from .errors import RequestFailed
from .jobs import Job, determinism_report, envelope, run_job, usage
from .protocol import error_body
from .state import ServerState
from .text import TextAssembler
from .worker import EngineWorker, Handle

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def chunk(job: Job, base: dict, text: str | None, ids: list[int], reason: str | None = None,
          first: bool = False) -> dict:
    """One chunk: a chat delta (the first names the role) or a completion's text."""
    c: dict = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": ids}
    if job.kind == "chat":
        delta: dict = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        c["delta"] = delta
    else:
        c["text"] = text or ""
    return {**base, "choices": [c]}


async def stream(state: ServerState, job: Job, handle: Handle) -> AsyncIterator[bytes]:
    assembler = TextAssembler(state.decode, job.params.stop_strings)
    include_usage = bool(job.params.stream_options and job.params.stream_options.include_usage)
    base = envelope(state, job)
    base["object"] = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    n_ids, finished = 0, False
    try:
        if job.kind == "chat":
            yield sse(chunk(job, base, "", [], first=True))
        async for ev in run_job(state, handle, assembler):
            if ev[0] == "delta":
                n_ids += len(ev[2])
                yield sse(chunk(job, base, ev[1], ev[2]))
            else:
                _, reason, result = ev
                final = chunk(job, base, None if job.kind == "chat" else "", [], reason)
                final["determinism"] = determinism_report(state, job, result)
                if not include_usage:
                    final["usage"] = usage(job, n_ids, result)
                yield sse(final)
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage(job, n_ids, result)})
        finished = True
        yield DONE
    except RequestFailed as exc:
        finished = True
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        yield sse(error_body(exc.message, kind, code=str(exc.status)))
        yield DONE
    finally:
        if not finished:  # the client went away (or the server cancelled us): free the slot now
            state.worker.abort(handle, "disconnect")


class EventStream(StreamingResponse):
    """SSE response that aborts its request however the response ends (client gone before the
    first chunk included): an aborted request's KV slot is freed at once."""

    def __init__(self, worker: EngineWorker, handle: Handle, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.worker, self.handle = worker, handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.worker.abort(self.handle, "disconnect")  # a no-op once the request has finished
