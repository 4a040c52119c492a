"""One API's endpoint over the serving core: how its body reads into a `Job` (`parsing.build_job`, the core's
one recipe), and how its answer is written, whole or streamed. `serve` is the flow every generation route
runs: parse, hand the choices to the engine thread (or refuse with a 429 / 503), then the stream or the
whole answer. Each API is a subclass: completions.py, chat.py, responses.py."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import ClassVar

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..core.events import Handle, Outcome
from ..core.jobs import Choice, Job, abort_all, complete, completion_body, next_event
from ..core.parsing import build_job, read_params
from ..core.state import ServerState
from ..core.streaming import ChunkWriter, EventStream, stream
from ..core.tools import NO_TOOLS, ToolPlan
from ..parsers.reasoning import Reasoning
from ..protocol import sdk_fields
from ..protocol.common import BadRequest
from ..protocol.errors import QueueFull, ShuttingDown, route_error

log = logging.getLogger("margingate.server")


class Endpoint:
    body: ClassVar[type]                     # the body's pydantic model
    id_prefix: ClassVar[str]
    prompt_param: ClassVar[str]              # the field an engine refusal of the prompt blames
    logprob_names: ClassVar[dict[str, str]] = {}  # SamplingParams' option -> this API's field, in refusals

    # --- the request ---------------------------------------------------------------------------------
    async def parse(self, state: ServerState, req: HTTPRequest) -> Job:
        return await build_job(state, self, await read_params(state, req, self.body))

    def tool_plan(self, state: ServerState, params) -> ToolPlan:
        """What the body's tools mean (core/tools.py): none, but on chat."""
        return NO_TOOLS

    async def prompts(self, state: ServerState, params, plan: ToolPlan) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids, and its text where the client sent text (echo returns it as sent)."""
        raise NotImplementedError

    def reasoning(self, state: ServerState, prompt_ids: list[int]) -> Reasoning | None:
        """How the answer to this prompt marks its reasoning (None: it has none to read)."""
        return None

    # --- the answer (completions' and chat's shape; responses.py writes its own) --------------------------
    object_name: ClassVar[str]
    chunk_object: ClassVar[str]

    render = staticmethod(completion_body)  # the whole answer's body: each choice_body, the reports, usage

    def choice_body(self, state: ServerState, job: Job, choice: Choice, outcome: Outcome) -> dict:
        raise NotImplementedError

    def top_fields(self, job: Job) -> dict:
        """The answer's fields beside its choices that this API adds (chat: the prompt's ids, where asked)."""
        return {}

    def stream(self, state: ServerState, job: Job, handles: list[Handle]) -> AsyncIterator[bytes]:
        """The answer as server-sent events (streaming.py, with the chunk hooks below)."""
        return stream(state, job, handles)

    def opening_chunks(self, writer: ChunkWriter, choice: Choice) -> Iterator[dict]:
        """The chunks that open a choice's stream, before its first tokens."""
        return iter(())

    def echo_chunk(self, writer: ChunkWriter, choice: Choice, prompt_lps: list) -> dict:
        """The chunk of a choice's prompt, where the request echoes it."""
        raise NotImplementedError(f"{type(self).__name__} does not echo its prompt")

    def content(self, text: str | None, delta: dict, first: bool) -> dict:
        """A chunk's content: its text (None: none), the delta's other fields, whether it is the first."""
        raise NotImplementedError

    def stream_logprobs(self, writer: ChunkWriter, choice: Choice, ids: list[int], lps: list, offsets: list[int]):
        raise NotImplementedError

    # --- the flow --------------------------------------------------------------------------------------
    async def serve(self, state: ServerState, req: HTTPRequest) -> Response:
        try:
            job = await self.parse(state, req)
        except BadRequest as exc:
            state.metrics.inc("requests_rejected_total", reason="invalid" if exc.status < 500 else "error")
            return route_error(req.url.path, exc.status, exc.message, param=exc.param, code=exc.code)
        handles = submit(state, job, req.url.path)
        response = handles if isinstance(handles, Response) else await self.answer(state, job, handles, req)
        if job.ignored:  # said, not refused: the client learns what had no effect
            log.info("%s: ignored unknown fields: %s", job.id, ", ".join(job.ignored))
            response.headers[sdk_fields.IGNORED_HEADER] = sdk_fields.header_value(job.ignored)
        return response

    async def answer(self, state: ServerState, job: Job, handles: list[Handle], req: HTTPRequest) -> Response:
        """Once the engine took the requests: a stream or the whole answer. Until one of them owns the
        requests, any way out (the engine's refusal, a cancelled handler) aborts them."""
        handed_over = False
        try:
            for handle in handles:
                event = await next_event(handle)  # "accepted", or the engine refused it
                if event.kind == "error":
                    return route_error(req.url.path, event.status, event.message, param=self.prompt_param,
                                       code="engine_error" if event.status >= 500 else "invalid_request")
            handed_over = True
            if job.params.streaming:
                return EventStream(state.worker, handles, self.stream(state, job, handles))
            return await complete(state, job, handles, req, self.render)
        finally:
            if not handed_over:
                abort_all(state, handles, "disconnect")


def submit(state: ServerState, job: Job, path: str) -> list[Handle] | Response:
    """Every choice handed to the engine thread, or the 429 / 503 that refuses the request (none runs), in the
    shape of the API `path` serves."""
    retry = {"Retry-After": str(state.config.retry_after_s)}
    handles: list[Handle] = []
    try:
        for choice in job.choices:
            handles.append(state.worker.submit(choice.request))
        return handles
    except QueueFull as exc:
        abort_all(state, handles, "aborted")
        state.metrics.inc("requests_rejected_total", reason="queue_full")
        return route_error(path, 429, f"server busy: {exc}; retry later", code="queue_full", headers=retry)
    except ShuttingDown as exc:
        abort_all(state, handles, "aborted")
        state.metrics.inc("requests_rejected_total", reason="unavailable")
        return route_error(path, 503, str(exc), code="unavailable", headers=retry)
