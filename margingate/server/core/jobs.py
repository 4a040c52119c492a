"""A generation request once accepted: its choices (n samples of each prompt) and the endpoint that serves
it (endpoint.py), the worker's per-request events (events.py) merged across choices, the response's envelope,
usage and determinism report, and the non-streaming answer."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ...engine import Request, Result
from ...engine.policy import Policy
from ..parsers.answer import Answer
from ..parsers.reasoning import Reasoning, ReasoningParser
from ..protocol.common import finite
from ..protocol.errors import RequestFailed, route_error
from .events import Event, Handle, Outcome
from .state import ServerState
from .tools import NO_TOOLS, ToolPlan


@dataclass
class Choice:
    """One answer of a request: sample j of prompt p is choice p * n + j."""
    index: int
    prompt_index: int
    prompt_text: str | None        # the prompt as the client sent it (echo), None if sent as ids
    request: Request


@dataclass
class Job:
    """One generation request, parsed and validated."""
    endpoint: Any                  # the API's endpoint (completions.py, chat.py, responses.py)
    params: Any
    policy: Policy
    id: str
    choices: list[Choice]
    tools: ToolPlan = NO_TOOLS     # what its tools mean, read once from the body (tools.py)
    ignored: list[str] = field(default_factory=list)  # unknown fields of the body: named in the answer's header
    origin: Any = None             # the body as its own API sent it, where that API is served as chat (responses)
    reasoning: Reasoning | None = None  # how the answer's reasoning is marked (reasoning.py), if it has one

    @property
    def echo(self) -> bool:
        return bool(getattr(self.params, "echo", False))

    def outcome(self, whole: bool) -> Outcome:
        """An empty outcome for one choice, its answer read by the tool plan's parser; `whole`: not streamed."""
        parser = self.tools.parser(whole)
        if self.reasoning is not None and not self.reasoning.harmony:  # harmony's parser reads its channels
            parser = ReasoningParser(self.reasoning, parser)
        return Outcome(parser, Answer(stripped=self.tools.mode != "none"))


# --- response pieces ---------------------------------------------------------------------

def determinism_report(state: ServerState, job: Job, choice: Choice, result: Result) -> dict:
    sp = choice.request.sampling
    promise = job.policy.promise  # derived from the request's options: a non-strict margin promises nothing
    # prompt logprobs always are: prompts run the invariant kernels whatever the policy
    logprobs = {**({"logprobs_guaranteed": promise.guarantees_logprobs} if sp.logprobs is not None else {}),
                **({"prompt_logprobs_guaranteed": True} if sp.prompt_logprobs is not None else {})}
    # kept in place across a weight swap (pause.py): two models chose its tokens, so no single run repeats it
    kept = promise.deterministic and "weight_versions" in result.stats
    guaranteed = promise.deterministic and not kept
    return finite({
        # three names clients already read, one fact
        "deterministic": guaranteed,
        "batch_invariant": guaranteed,
        "guaranteed": guaranteed,
        **logprobs,
        **({"logprobs_guaranteed": False} if kept and "logprobs_guaranteed" in logprobs else {}),
        **({"warning": KEPT_ACROSS_SWAP} if kept else {}),
        # the stats carry `weight_version`, the weights it ran under (Engine.result; the environment's
        # model_fingerprint names those loaded at start)
        **result.stats,
        "temperature": sp.temperature,
        "seed": sp.seed if sp.temperature > 0 else None,
        "engine_finish_reason": result.finish_reason,
        "environment": state.environment,
    })


KEPT_ACROSS_SWAP = ("the weights were updated while this request was kept in place: weight_versions chose its "
                    "tokens, the later one from output token weights_updated_at_token on")


def envelope(state: ServerState, job: Job, object_name: str) -> dict:
    return {"id": job.id, "object": object_name, "created": int(time.time()), "model": state.model_id,
            "system_fingerprint": state.fingerprint}


def completion_body(state: ServerState, job: Job, outcomes: dict[int, Outcome]) -> dict:
    """The whole body of completions and chat: each choice's (its endpoint's `choice_body`), its report (on
    each choice where there are several), usage."""
    body = envelope(state, job, job.endpoint.object_name)
    body["choices"] = [job.endpoint.choice_body(state, job, c, outcomes[c.index]) for c in job.choices]
    body.update(job.endpoint.top_fields(job))
    reports = [determinism_report(state, job, c, outcomes[c.index].result) for c in job.choices]
    if len(reports) > 1:
        for choice, report in zip(body["choices"], reports):
            choice["determinism"] = report
    body.update(usage=usage(job, outcomes), determinism=reports[0])
    return body


def usage(job: Job, outcomes: dict[int, Outcome]) -> dict:
    """Prompt tokens once per prompt (its n samples share the prefill), completion tokens per choice."""
    prompts = {c.prompt_index: len(c.request.prompt_ids) for c in job.choices}
    n_prompt, n_out = sum(prompts.values()), sum(len(o.ids) for o in outcomes.values())
    out = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    # As OpenAI reports it: prompt positions served from the prefix cache, once per prompt (the choice that
    # prefilled it: its n samples share that prefill, so their forks are no second saving, and the count
    # never exceeds prompt_tokens).
    cached: dict[int, int] = {}
    for c in job.choices:
        result = outcomes[c.index].result if c.index in outcomes else None
        if result is not None:
            cached[c.prompt_index] = min(cached.get(c.prompt_index, result.cached_tokens), result.cached_tokens)
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
    if job.reasoning is not None:  # as OpenAI reports a reasoning model's
        out["completion_tokens_details"] = {"reasoning_tokens": sum(o.reasoning_tokens for o in outcomes.values())}
    return out


# --- the worker's events ------------------------------------------------------------------

async def next_event(handle: Handle) -> Event:
    return await handle.events.get()


async def run_job(handle: Handle) -> AsyncIterator[Event]:
    """The request's events after `accepted` (prompt, tokens, done: events.py); raises RequestFailed."""
    while True:
        event = await next_event(handle)
        if event.kind == "error":
            raise RequestFailed(event.status, event.message)
        yield event
        if event.kind == "done":
            return


async def merged(state: ServerState, job: Job, handles: list[Handle]) -> AsyncIterator[tuple[Choice, Event]]:
    """Every choice's events as they come, tagged with the choice; the first failure raises."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice, handle: Handle) -> None:
        try:
            async for ev in run_job(handle):
                await queue.put((choice, ev))
        except RequestFailed as exc:
            await queue.put((choice, exc))
        await queue.put((choice, None))

    tasks = [asyncio.ensure_future(pump(c, h)) for c, h in zip(job.choices, handles)]
    try:
        remaining = len(tasks)
        while remaining:
            choice, ev = await queue.get()
            if isinstance(ev, RequestFailed):
                raise ev
            if ev is None:
                remaining -= 1
            else:
                yield choice, ev
    finally:
        for t in tasks:
            t.cancel()


def abort_all(state: ServerState, handles: list[Handle], reason: str) -> None:
    for h in handles:
        state.worker.abort(h, reason)


# --- the non-streaming answer ----------------------------------------------------------------

async def wait_disconnect(req: HTTPRequest) -> None:
    while True:
        message = await req.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(state: ServerState, job: Job, handles: list[Handle]) -> dict[int, Outcome]:
    """Every choice's whole answer."""
    outcomes = {c.index: job.outcome(whole=True) for c in job.choices}
    async for choice, event in merged(state, job, handles):
        outcomes[choice.index].take(event)
    return outcomes


async def complete(state: ServerState, job: Job, handles: list[Handle], req: HTTPRequest,
                   render: Callable[..., dict]) -> Response:
    """Runs the request to its end, or aborts it (freeing its KV blocks) when the client goes away;
    `render(state, job, outcomes)` makes the body."""
    task = asyncio.ensure_future(collect(state, job, handles))
    gone = asyncio.ensure_future(wait_disconnect(req))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            abort_all(state, handles, "disconnect")
        gone.cancel()
    if task not in done:
        return Response(status_code=499)  # nobody is listening
    try:
        outcomes = task.result()
    except RequestFailed as exc:
        abort_all(state, handles, "aborted")
        return route_error(req.url.path, exc.status, exc.message, code="engine_error" if exc.status >= 500 else None)
    return JSONResponse(render(state, job, outcomes))
