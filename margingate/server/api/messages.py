"""`POST /v1/messages` (Anthropic's Messages API), a thin endpoint over the chat one: the body becomes the chat body
it means (`messages_request.py`), which runs the chat path unchanged; its one choice is written back as a
Message: `content` blocks in the order the model wrote them (`thinking` for its reasoning, `text`, a `tool_use`
per call with its `input` object), `stop_reason` (end_turn, max_tokens, tool_use), `usage` in Anthropic's names,
and our `determinism` report.

Streamed, the events Anthropic's SDKs read, each an SSE `event:` line and its data: message_start, per block
content_block_start, content_block_delta... (text_delta, thinking_delta, input_json_delta: a call's arguments
in fragments as they are released) and content_block_stop, then message_delta (the stop reason, the output
tokens) and message_stop; an engine failure is an `error` event. Blocks follow each other, as Anthropic's do,
and the stream's blocks are the whole answer's, bitwise, under a deterministic policy. Errors on this route are
Anthropic's body (`errors.anthropic_error`: invalid_request_error, authentication_error, rate_limit_error, ...,
with the status the other routes answer); a refusal names the Messages field.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

from fastapi import Request as HTTPRequest

from ..core.events import Handle, Outcome
from ..core.jobs import Job, abort_all, determinism_report, merged, usage
from ..core.parsing import build_job, json_object, read_body, validate
from ..core.state import ServerState
from ..parsers.answer import Answer
from ..parsers.call_parser import Piece
from ..protocol.common import BadRequest
from ..protocol.errors import RequestFailed
from .chat import ChatEndpoint
from .messages_request import messages_param, read_request

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def block(answer: Answer, segment: list) -> dict:
    """One content block of the answer, whole."""
    kind, value = segment
    if kind == "reasoning":
        return {"type": "thinking", "thinking": value, "signature": ""}
    if kind == "text":
        return {"type": "text", "text": value}
    call = answer.calls[value]
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"] or "{}")}


def opened(answer: Answer, piece: Piece) -> dict:
    """The block a piece opens, as its stream announces it: empty."""
    if piece.kind == "call":
        call = answer.calls[piece.index]
        return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
    return {"type": "thinking", "thinking": "", "signature": ""} if piece.kind == "reasoning" else \
        {"type": "text", "text": ""}


def message(state: ServerState, job: Job, o: Outcome | None, content: list[dict]) -> dict:
    counts = usage(job, {job.choices[0].index: o}) if o is not None else None
    body = {"id": job.id, "type": "message", "role": "assistant", "model": state.model_id, "content": content,
            "stop_reason": STOP.get(o.finish_reason, o.finish_reason) if o is not None and o.result else None,
            "stop_sequence": None,
            "usage": {"input_tokens": counts["prompt_tokens"] if counts else len(job.choices[0].request.prompt_ids),
                      "output_tokens": counts["completion_tokens"] if counts else 0}}
    if o is not None and o.result is not None:
        body["determinism"] = determinism_report(state, job, job.choices[0], o.result)
    return body


class MessagesEndpoint(ChatEndpoint):
    id_prefix = "msg_"

    async def parse(self, state: ServerState, req: HTTPRequest) -> Job:
        """The Messages body as the chat `Job` it means; a refusal names the Messages field."""
        try:
            params = read_request(json_object(await read_body(req, state.config.max_body_bytes)))
            job = await build_job(state, self, validate(state, params.chat_body(), self.body))
        except BadRequest as exc:
            exc.param = messages_param(exc.param)
            raise
        job.ignored = params.ignored_fields()
        return job

    def render(self, state: ServerState, job: Job, outcomes: dict[int, Outcome]) -> dict:
        o = outcomes[job.choices[0].index]
        content = [block(o.answer, s) for s in o.answer.segments] or [{"type": "text", "text": ""}]
        return message(state, job, o, content)

    async def stream(self, state: ServerState, job: Job, handles: list[Handle]) -> AsyncIterator[bytes]:
        o, blocks, finished = job.outcome(whole=False), BlockStream(), False
        try:
            yield event("message_start", message=message(state, job, None, []))
            async for _, released in merged(state, job, handles):
                for chunk in blocks.pieces(o.take(released), o.answer):
                    yield chunk
            for chunk in blocks.close(o.answer):
                yield chunk
            whole = message(state, job, o, [])
            finished = True
            yield event("message_delta", delta={"stop_reason": whole["stop_reason"], "stop_sequence": None},
                        usage={"output_tokens": whole["usage"]["output_tokens"]}, determinism=whole["determinism"])
            yield event("message_stop")
        except RequestFailed as exc:
            finished = True
            abort_all(state, handles, "aborted")
            yield event("error", error={"type": "api_error" if exc.status >= 500 else "invalid_request_error",
                                        "message": exc.message})
        finally:
            if not finished:  # the client went away (or the server cancelled us): free the KV blocks now
                abort_all(state, handles, "disconnect")


def event(type_: str, **fields) -> bytes:
    return f"event: {type_}\ndata: {json.dumps({'type': type_, **fields}, ensure_ascii=False)}\n\n".encode()


class BlockStream:
    """The answer's pieces as content-block events, one block at a time: a block opens when its first piece
    comes (where the answer's next segment begins: answer.py), the one before it closes then."""

    DELTAS = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking"),
              "args": ("input_json_delta", "partial_json")}

    def __init__(self):
        self.count, self.kind = 0, None   # blocks opened, the open one's kind

    def pieces(self, pieces: list[Piece], answer: Answer) -> Iterator[bytes]:
        for p in pieces:
            if p.kind == "call" or (p.kind in ("text", "reasoning") and p.text and p.kind != self.kind):
                if self.count:
                    yield event("content_block_stop", index=self.count - 1)
                yield event("content_block_start", index=self.count, content_block=opened(answer, p))
                self.count, self.kind = self.count + 1, p.kind
            if p.kind in self.DELTAS and p.text:
                kind, name = self.DELTAS[p.kind]
                yield event("content_block_delta", index=self.count - 1, delta={"type": kind, name: p.text})

    def close(self, answer: Answer) -> Iterator[bytes]:
        if not self.count:  # nothing was written: one empty text block, as the whole answer has
            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            self.count = 1
        yield event("content_block_stop", index=self.count - 1)


MESSAGES = MessagesEndpoint()
