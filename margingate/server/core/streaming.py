"""The streaming answer of completions and chat: server-sent events, one chunk per released delta of each
choice (tagged with its index, carrying its logprobs; chat's with its content, reasoning and the calls' names
and argument fragments as the answer's parser decides them: call_parser.py), each choice's last chunk with its
determinism report, usage once every choice is done, `data: [DONE]`; a client gone mid-stream frees the KV
blocks at once. What a chunk holds is the endpoint's (completions.py, chat.py)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from ..parsers.answer import Answer
from ..parsers.call_parser import Piece
from ..protocol.common import error_body
from ..protocol.errors import RequestFailed
from .events import Handle
from .jobs import Choice, Job, abort_all, determinism_report, envelope, merged, usage
from .state import ServerState
from .worker import EngineWorker

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def pieces_delta(pieces: list[Piece], answer: Answer) -> tuple[str | None, dict]:
    """A delta's text (None: none) and its other fields: the reasoning, and each call that opened (its
    index, id and name) or grew (its arguments' fragment), as OpenAI streams them."""
    texts = [p.text for p in pieces if p.kind == "text"]
    reasoning = [p.text for p in pieces if p.kind == "reasoning"]
    calls: dict[int, dict] = {}
    for p in pieces:
        if p.kind == "call":
            calls[p.index] = {"index": p.index, "id": answer.calls[p.index]["id"], "type": "function",
                              "function": {"name": p.name, "arguments": ""}}
        elif p.kind == "args":
            call = calls.setdefault(p.index, {"index": p.index, "function": {"arguments": ""}})
            call["function"]["arguments"] += p.text
    delta = {**({"reasoning_content": "".join(reasoning)} if reasoning else {}),
             **({"tool_calls": list(calls.values())} if calls else {})}
    return ("".join(texts) if texts else None), delta


class ChunkWriter:
    """Chunks of one response, each choice's text offsets (completions' logprobs) kept apart."""

    def __init__(self, state: ServerState, job: Job):
        self.state, self.job, self.endpoint = state, job, job.endpoint
        self.base = envelope(state, job, self.endpoint.chunk_object)
        self.text_start = {c.index: 0 for c in job.choices}  # the echoed prompt's length, if echoed

    def chunk(self, choice: Choice, text: str | None, ids: list[int], lps: list | None = None,
              reason: str | None = None, first: bool = False, offsets: list[int] = (),
              delta: dict | None = None) -> dict:
        """One chunk: its text (chat: its content; `delta`: the delta's other fields; `first`: it names the role)."""
        c: dict = {"index": choice.index, "finish_reason": reason,
                   "logprobs": self.logprobs(choice, ids, lps, offsets), "token_ids": ids,
                   **self.endpoint.content(text, delta or {}, first)}
        return {**self.base, "choices": [c]}

    def logprobs(self, choice: Choice, ids: list[int], lps: list | None, offsets: list[int]):
        if choice.request.sampling.logprobs is None or lps is None:
            return None
        return self.endpoint.stream_logprobs(self, choice, ids, lps, offsets)

    def pieces(self, choice: Choice, pieces: list[Piece], answer: Answer, ids: list[int] = (), lps=None,
               offsets: list[int] = ()) -> dict:
        text, delta = pieces_delta(pieces, answer)
        return self.chunk(choice, text, list(ids), lps, offsets=offsets, delta=delta)


async def stream(state: ServerState, job: Job, handles: list[Handle]) -> AsyncIterator[bytes]:
    endpoint, writer = job.endpoint, ChunkWriter(state, job)
    include_usage = bool(job.params.stream_options and job.params.stream_options.include_usage)
    outcomes = {c.index: job.outcome(whole=False) for c in job.choices}
    finished = False
    try:
        for c in job.choices:
            for chunk in endpoint.opening_chunks(writer, c):
                yield sse(chunk)
        async for choice, event in merged(state, job, handles):
            o = outcomes[choice.index]
            pieces = o.take(event)
            if event.kind == "prompt":
                yield sse(endpoint.echo_chunk(writer, choice, event.prompt_logprobs))
            elif event.kind == "tokens":
                yield sse(writer.pieces(choice, pieces, o.answer, event.ids, event.logprobs, event.offsets))
            elif event.kind == "done":
                if pieces:  # what the parser held until the end
                    yield sse(writer.pieces(choice, pieces, o.answer))
                final = writer.chunk(choice, None, [], None, o.finish_reason)
                final["determinism"] = determinism_report(state, job, choice, o.result)
                if not include_usage and all(x.result is not None for x in outcomes.values()):
                    final["usage"] = usage(job, outcomes)
                yield sse(final)
        if include_usage:
            yield sse({**writer.base, "choices": [], "usage": usage(job, outcomes)})
        finished = True
        yield DONE
    except RequestFailed as exc:
        finished = True
        abort_all(state, handles, "aborted")
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        yield sse(error_body(exc.message, kind, code=str(exc.status)))
        yield DONE
    finally:
        if not finished:  # the client went away (or the server cancelled us): free the KV blocks now
            abort_all(state, handles, "disconnect")


class EventStream(StreamingResponse):
    """SSE response that aborts its requests however the response ends (client gone before the
    first chunk included): an aborted request's KV blocks are freed at once."""

    def __init__(self, worker: EngineWorker, handles: list[Handle], content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.worker, self.handles = worker, handles

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for h in self.handles:
                self.worker.abort(h, "disconnect")  # a no-op once the request has finished
