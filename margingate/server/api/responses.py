"""`POST /v1/responses`, served as a chat completion: the body becomes a chat body (`responses_request.py`), which
runs the chat path unchanged (template, tools, grammar, policy); its one choice is written back as a Response
object: `output` items (a `reasoning` item where the model reasoned, an assistant `message` with its `output_text`, a
`function_call` per tool call, in the order written),
`status` (`incomplete` where max_output_tokens cut it), `usage` in the Responses' names, and the `determinism`
report as on the other routes. Asked for (`top_logprobs`, or `include` naming them), the output_text carries
the logprobs of the answer's tokens after its reasoning (a call's tokens among them, as written), in chat's
entries (`logprobs.py`); else `[]`.

Streamed, the events are the ones the openai SDK's `responses.stream()` accumulates, each with its `type` and
`sequence_number`: response.created, response.in_progress, per item response.output_item.added, (a reasoning
item: response.reasoning_text.delta..., response.reasoning_text.done) (a message)
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, (a call) response.function_call_arguments.delta / .done, response.output_item.done,
and last response.completed (response.incomplete; response.failed if the engine fails the request). Items go
out as the engine releases their tokens: the message at its first text, a call when its name is read, then
its arguments in fragments (`call_parser.py`); every item is closed at the end, in output order. The streamed
answer is the whole one's: a strict policy releases verified tokens only (`streaming.py`). A text delta carries
the logprobs of the tokens released since the last one (what the parser held goes with the text it frees), the
rest goes in a last empty delta, so the deltas' logprobs joined are the whole text's.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from fastapi import Request as HTTPRequest

from ..core.events import Handle, Outcome
from ..core.jobs import Job, abort_all, determinism_report, merged, usage
from ..core.parsing import build_job, json_object, read_body, validate
from ..core.state import ServerState
from ..parsers.answer import Answer
from ..parsers.call_parser import Piece
from ..protocol.common import BadRequest
from ..protocol.errors import RequestFailed
from ..protocol.logprobs import LogprobFormatter
from .chat import ChatEndpoint
from .responses_request import FunctionChoice, read_request, responses_param


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def call_item_id(call: dict) -> str:
    """A function_call item's id, from its call's (the stream's and the last event's are the same)."""
    return f"fc_{call['id'].removeprefix('call_')}"


def message_item(message_id: str, status: str, text: str, logprobs: list[dict]) -> dict:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def call_item(call: dict, status: str) -> dict:
    return {"type": "function_call", "id": call_item_id(call), "call_id": call["id"], "status": status,
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def reasoning_item(reasoning_id: str, status: str, text: str) -> dict:
    return {"type": "reasoning", "id": reasoning_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(answer: Answer, ids: dict[str, str], status: str, logprobs: list[dict]) -> list[dict]:
    """The answer as output items, in the order they were written: its reasoning, its calls, and its text
    (always, unless it is calls only) where it began among them; `ids`: the message's and the reasoning's."""
    items = [call_item(call, status) for call in answer.calls]
    content = answer.message()["content"]
    if content is not None or not items:
        items.insert(answer.message_at or 0, message_item(ids["message"], status, content or "", logprobs))
    if answer.reasoning is not None:
        items.insert(0, reasoning_item(ids["reasoning"], status, answer.reasoning))
    return items


def formatter(state: ServerState, job: Job) -> LogprobFormatter | None:
    """The formatter of the text's logprobs, where the request asked for them."""
    return state.formatter if job.choices[0].request.sampling.logprobs is not None else None


def envelope(state: ServerState, job: Job, status: str, output: list[dict]) -> dict:
    """A Response object without its usage and report: the request's settings as it was served."""
    p, chat = job.origin, job.params
    text_format = p.text.format.model_dump(by_alias=True, exclude_none=True) if p.text and p.text.format else None
    return {"id": job.id, "object": "response", "created_at": int(time.time()), "status": status,
            "model": state.model_id, "output": output, "error": None, "incomplete_details": None,
            "instructions": p.instructions, "max_output_tokens": p.max_output_tokens,
            "temperature": chat.greedy_temperature, "top_p": 1.0 if chat.top_p is None else chat.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in p.tools or []],
            # the plan's mode ("auto" where tools came without a choice); a named one in this API's shape
            "tool_choice": p.tool_choice.model_dump() if isinstance(p.tool_choice, FunctionChoice) else job.tools.mode,
            "parallel_tool_calls": p.parallel_tool_calls is not False, "text": {"format": text_format or
                                                                                 {"type": "text"}},
            "reasoning": None, "store": False, "previous_response_id": None, "truncation": "disabled",
            "metadata": chat.metadata or {}, "system_fingerprint": state.fingerprint}


def response_body(state: ServerState, job: Job, outcomes: dict[int, Outcome], ids: dict | None = None) -> dict:
    """The whole Response of a finished job (its one choice); `ids`: its message's and reasoning's item ids."""
    choice = job.choices[0]
    o = outcomes[choice.index]
    status = "incomplete" if o.reason == "length" else "completed"
    ids = ids or {"message": item_id("msg"), "reasoning": item_id("rs")}
    fmt = formatter(state, job)
    logprobs = [] if fmt is None else fmt.tokens(o.logprobs[o.reasoning_tokens:])
    body = envelope(state, job, status, output_items(o.answer, ids, status, logprobs))
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    counts = usage(job, outcomes)
    body["usage"] = {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                     "total_tokens": counts["total_tokens"],
                     "input_tokens_details": {"cached_tokens": counts.get("prompt_tokens_details", {})
                                              .get("cached_tokens", 0)},
                     "output_tokens_details": {"reasoning_tokens": counts.get("completion_tokens_details", {})
                                               .get("reasoning_tokens", 0)}}
    body["determinism"] = determinism_report(state, job, choice, o.result)
    return body


# --- the stream --------------------------------------------------------------------------------

def opening(event: Callable[..., bytes], index: int, item: dict) -> Iterator[bytes]:
    """An item announced, empty (a message with its one empty text part)."""
    if item["type"] == "message":
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "content": []})
        yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})
    elif item["type"] == "reasoning":
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "summary": [], "content": []})
    else:
        yield event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""})


def closing(event: Callable[..., bytes], index: int, item: dict) -> Iterator[bytes]:
    """An item's last events: its whole text or arguments, then the item as it stands in the answer."""
    if item["type"] == "message":
        part = item["content"][0]
        yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=part["text"], logprobs=part["logprobs"])
        yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
    elif item["type"] == "reasoning":
        yield event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=item["content"][0]["text"])
    else:
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=index, item=item)


def writer() -> Callable[..., bytes]:
    """SSE events numbered in the order they are written."""
    numbers = itertools.count()

    def event(type_: str, **fields) -> bytes:
        payload = json.dumps({"type": type_, "sequence_number": next(numbers), **fields}, ensure_ascii=False)
        return f"event: {type_}\ndata: {payload}\n\n".encode()
    return event


class ItemStream:
    """The answer's pieces as Responses events: an item is announced when its first piece comes (the reasoning
    and the message at their first text, a call when it opens), then grows by deltas; `index` is each item's
    output_index; `fmt`: the text's logprobs' formatter, None where they were not asked for."""

    def __init__(self, event: Callable[..., bytes], outcome: Outcome, fmt: LogprobFormatter | None):
        self.event, self.outcome, self.answer, self.fmt = event, outcome, outcome.answer, fmt
        self.ids = {"message": item_id("msg"), "reasoning": item_id("rs")}
        self.index: dict = {}   # "message", "reasoning", or a call's index -> its output_index
        self.sent: int | None = None   # the text's logprobs sent: up to this token (None: none yet)

    def unsent(self) -> int:
        """Where the text's logprobs not sent yet begin (the reasoning is settled once text comes: its tokens
        are not the text's)."""
        return self.outcome.reasoning_tokens if self.sent is None else self.sent

    def logprobs(self) -> list[dict]:
        if self.fmt is None:
            return []
        start, self.sent = self.unsent(), len(self.outcome.logprobs)
        return self.fmt.tokens(self.outcome.logprobs[start:])

    def open(self, key, item: dict) -> Iterator[bytes]:
        self.index[key] = len(self.index)
        yield from opening(self.event, self.index[key], item)

    def text(self, key: str, text: str) -> Iterator[bytes]:
        """A delta of the message's text or of the reasoning's, its item announced first."""
        if key not in self.index:
            yield from self.open(key, {"type": key, "id": self.ids[key], **({"role": "assistant"}
                                                                            if key == "message" else {})})
        kind = "output_text" if key == "message" else "reasoning_text"
        yield self.event(f"response.{kind}.delta", item_id=self.ids[key], output_index=self.index[key],
                         content_index=0, delta=text, **({"logprobs": self.logprobs()} if key == "message" else {}))

    def pieces(self, pieces: list[Piece]) -> Iterator[bytes]:
        for p in pieces:
            if p.kind in ("text", "reasoning") and p.text:
                yield from self.text("message" if p.kind == "text" else "reasoning", p.text)
            elif p.kind == "call":
                yield from self.open(p.index, call_item(self.answer.calls[p.index], "in_progress"))
            elif p.kind == "args":
                yield self.event("response.function_call_arguments.delta", output_index=self.index[p.index],
                                 item_id=call_item_id(self.answer.calls[p.index]), delta=p.text)

    def close(self, body: dict) -> Iterator[bytes]:
        """Every item's last events, in output order (an empty message announced first where none was)."""
        for index, item in enumerate(body["output"]):
            if index == len(self.index):
                yield from self.open("message", item)
            if item["type"] == "message" and self.fmt is not None and self.unsent() < len(self.outcome.logprobs):
                yield from self.text("message", "")   # the tokens after the last text (held whitespace, EOS)
            yield from closing(self.event, index, item)


async def stream(state: ServerState, job: Job, handles: list[Handle]) -> AsyncIterator[bytes]:
    event, o, finished = writer(), job.outcome(whole=False), False
    items = ItemStream(event, o, formatter(state, job))
    try:
        for name in ("response.created", "response.in_progress"):
            yield event(name, response=envelope(state, job, "in_progress", []))
        async for _, released in merged(state, job, handles):
            for chunk in items.pieces(o.take(released)):
                yield chunk
        body = response_body(state, job, {job.choices[0].index: o}, ids=items.ids)
        for chunk in items.close(body):
            yield chunk
        finished = True
        yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
    except RequestFailed as exc:
        finished = True
        abort_all(state, handles, "aborted")
        failed = {**envelope(state, job, "failed", []), "error": {"code": "server_error" if exc.status >= 500
                                                                  else "invalid_prompt", "message": exc.message}}
        yield event("response.failed", response=failed)
    finally:
        if not finished:  # the client went away (or the server cancelled us): free the KV blocks now
            abort_all(state, handles, "disconnect")


class ResponsesEndpoint(ChatEndpoint):
    """/v1/responses: the body translated into the chat body it means (responses_request.py), served as chat,
    its one choice written back as a Response."""
    id_prefix = "resp_"
    prompt_param = "input"

    async def parse(self, state: ServerState, req: HTTPRequest) -> Job:
        """The Responses body as the chat `Job` it means; a refusal names the Responses field."""
        params = read_request(json_object(await read_body(req, state.config.max_body_bytes)))
        try:
            job = await build_job(state, self, validate(state, params.chat_body(), self.body))
        except BadRequest as exc:
            exc.param = responses_param(exc.param)
            raise
        job.ignored, job.origin = params.ignored_fields(), params
        return job

    def render(self, state: ServerState, job: Job, outcomes: dict[int, Outcome]) -> dict:
        return response_body(state, job, outcomes)

    def stream(self, state: ServerState, job: Job, handles: list[Handle]) -> AsyncIterator[bytes]:
        return stream(state, job, handles)


RESPONSES = ResponsesEndpoint()
