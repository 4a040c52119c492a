"""The FastAPI app: OpenAI-compatible routes in front of one engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, GET /metrics. With an API key every route but /health needs
`Authorization: Bearer <key>`.

Per-request determinism: `"deterministic": true` runs the request under the
server's default deterministic policy (margin, the model profile's tau);
`"determinism": {...}` picks the policy and its options. Without either the
request runs on the fast path (policy `fast`: reproducible alone, not across
batches). The response's `determinism` object is the policy's report for this
request (triggers, repairs, rollbacks, ...) plus the environment the contract
depends on.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..data.prompts import Prompt
from ..engine import Engine, Request, Result
from ..engine.policy import Policy
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    OPENAI_FINISH,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    finite,
    parse_json_body,
    validation_message,
)
from .worker import EngineWorker, Handle, QueueFull, ShuttingDown

log = logging.getLogger("margingate.server")

DEFAULT_POLICY = "margin"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class RequestFailed(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_queue: int = 64
    default_policy: str = DEFAULT_POLICY
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 30.0
    retry_after_s: int = 1


class ServerState:
    def __init__(self, llm, engine: Engine, config: ServerConfig):
        self.llm, self.engine, self.config = llm, engine, config
        self.model_id = llm.model_name
        self.created = int(time.time())
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, self.metrics, max_queue=config.max_queue)
        self.environment = llm.environment()
        self.environment["num_threads"] = engine.num_threads
        self.fingerprint = (f"{self.environment['model_fingerprint']}-{self.environment['device']}"
                            f"-t{engine.num_threads}")
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        m, w = self.metrics, self.worker
        m.gauge("queue_length", "requests accepted and waiting for a KV slot", lambda: w.queue_length)
        m.gauge("running_requests", "requests holding a KV slot", lambda: w.running)
        m.gauge("in_flight_requests", "requests accepted and not finished", lambda: w.in_flight)
        m.gauge("kv_slots_free", "free KV slots", lambda: engine.kv.num_free)
        m.gauge("max_queue", "queued requests allowed beyond the running ones", lambda: config.max_queue)
        m.gauge("engine_alive", "1 while the engine thread runs", lambda: 1.0 if w.alive else 0.0)

    # --- tokenizer (serialized) -----------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        with self.tokenizer_lock:
            return self.llm.tokenizer.encode_prompt(prompt)

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.llm.tokenizer.decode(ids)


# --- responses ---------------------------------------------------------------------------

def json_error(status: int, message: str, *, param: str | None = None, code: str | None = None,
               headers: dict | None = None) -> JSONResponse:
    type_ = ("invalid_request_error" if status < 500 else "server_error")
    if status == 401:
        type_ = "authentication_error"
    elif status == 429:
        type_ = "rate_limit_error"
    elif status == 503:
        type_ = "service_unavailable"
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


class TextAssembler:
    """Released token ids -> text deltas; cuts at the first stop string and never emits half a
    character or the start of a possible stop string before it is decided.

    Detokenizes incrementally (a window from the last complete character, as vLLM does), so a long
    answer costs O(n), not O(n^2); the final flush decodes the whole answer once, so the text is
    always exactly decode(token_ids), cut at the first stop string.
    """

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.decoded = ""             # complete characters decoded so far
        self.text = ""                # emitted so far
        self.stopped = False

    def feed(self, new_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += new_ids
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):  # not inside a UTF-8 sequence
            self.decoded += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._advance(self.decoded, final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._advance(self.decode(self.ids), final=True)

    def _advance(self, full: str, final: bool) -> str:
        if not full.startswith(self.text):  # the decoder rewrote earlier text: keep what was sent
            return ""
        # a stop string never starts inside emitted text: a possible start is always held back
        cut = min((i for i in (full.find(s, len(self.text)) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(full[:cut])
        end = len(full)
        if not final:
            for s in self.stops:  # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, end - len(self.text)), 0, -1):
                    if full.endswith(s[:k]):
                        end = min(end, len(full) - k)
                        break
        return self._emit(full[:end])

    def _emit(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text = upto if len(upto) > len(self.text) else self.text
        return delta


@dataclass
class Job:
    """One generation request, parsed and validated."""
    kind: str                      # "completion" or "chat"
    params: Any
    request: Request
    policy: Policy
    deterministic: bool
    id: str


def build_policy(state: ServerState, params, streaming: bool) -> tuple[Policy, bool]:
    block = params.determinism
    if params.deterministic is False and block is not None and block.policy != "fast":
        raise BadRequest('"deterministic": false contradicts the "determinism" block; drop one',
                         param="deterministic")
    if block is None and not params.deterministic:
        return state.llm.policy("fast"), False
    if params.deterministic and block is not None and block.policy == "fast":
        raise BadRequest('"deterministic": true needs a batch-invariant policy, not "fast"',
                         param="determinism.policy")
    name = block.policy if block is not None else state.config.default_policy
    opts: dict[str, Any] = {"strict": not streaming}  # streaming margin: release at once unless asked
    if block is not None:
        if block.tau is not None:
            opts["tau"] = block.tau
        if block.repair is not None:
            opts["repair"] = block.repair
        if block.strict is not None:
            opts["strict"] = block.strict
        opts["precision"] = block.verifier_precision
        if block.window is not None:
            opts["window"] = block.window
        if block.group is not None:
            opts["group"] = block.group
    try:
        policy = state.llm.policy(name, **opts)
    except ValueError as exc:
        raise BadRequest(str(exc), param="determinism") from None
    return policy, name != "fast"


def determinism_report(state: ServerState, job: Job, result: Result) -> dict:
    req = job.request
    return finite({
        "deterministic": job.deterministic,
        "batch_invariant": job.policy.name != "fast",
        **result.stats,
        "temperature": req.temperature,
        "seed": req.seed if req.temperature > 0 else None,
        "engine_finish_reason": result.finish_reason,
        "environment": state.environment,
    })


# --- the app -------------------------------------------------------------------------------

def create_app(llm, *, api_key: str | None = None, max_queue: int = 64, engine: Engine | None = None,
               default_policy: str = DEFAULT_POLICY, default_max_tokens: int = 256,
               max_body_bytes: int = 1 << 20, shutdown_grace_s: float = 30.0) -> FastAPI:
    """An app serving `llm` (its tokenizer, policies and, unless `engine` is given, its engine).

    max_queue: requests accepted beyond the engine's KV slots; past that, 429 with Retry-After.
    default_policy: what `"deterministic": true` means. default_max_tokens: when a body gives none.
    """
    llm.policy(default_policy)  # refuse a bad default up front
    if default_max_tokens < 1:
        raise ValueError("default_max_tokens must be >= 1")
    config = ServerConfig(api_key or None, max_queue, default_policy, default_max_tokens, max_body_bytes,
                          shutdown_grace_s)
    state = ServerState(llm, engine or llm.engine, config)

    @asynccontextmanager
    async def lifespan(_app):
        state.worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.worker.shutdown, config.shutdown_grace_s)

    app = FastAPI(title="margingate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    # --- errors ---------------------------------------------------------------------------
    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        return json_error(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                          headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):
        log.exception("unhandled error")
        return json_error(500, f"internal error: {type(exc).__name__}: {exc}")

    # --- plain routes ------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        w = state.worker
        status = "ok" if w.alive and w.accepting else "draining" if w.alive else "engine stopped"
        body = {"status": status, "model": state.model_id,
                "in_flight": w.in_flight, "running": w.running, "queued": w.queue_length,
                "kv_slots_free": state.engine.kv.num_free, "last_error": w.last_error}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "margingate",
                "max_model_len": state.engine.max_len, "determinism": {
                    "default_policy": config.default_policy, "default_tau": llm.default_tau,
                    "tau_source": state.environment.get("tau_source")}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_id:
            return json_error(404, f"the model {model_id!r} does not exist; this server serves "
                                   f"{state.model_id!r}", param="model", code="model_not_found")
        return model_card()

    # --- generation ---------------------------------------------------------------------------
    async def read_body(req: HTTPRequest) -> bytes:
        declared = req.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise BadRequest(f"request body too large (limit {config.max_body_bytes} bytes)", status=413,
                             code="body_too_large")
        chunks, size = [], 0
        async for chunk in req.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise BadRequest(f"request body too large (limit {config.max_body_bytes} bytes)", status=413,
                                 code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(req: HTTPRequest, kind: str) -> Job:
        body = parse_json_body(await read_body(req))
        if not isinstance(body, dict):
            raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            params = model_cls.model_validate(body)
        except ValidationError as exc:
            message, param = validation_message(exc)
            raise BadRequest(message, param=param) from None
        if params.model is not None and params.model != state.model_id:
            raise BadRequest(f"the model {params.model!r} does not exist; this server serves {state.model_id!r}",
                             param="model", status=404, code="model_not_found")
        policy, deterministic = build_policy(state, params, params.streaming)
        temperature = params.greedy_temperature
        if deterministic and temperature > 0 and params.seed is None:
            raise BadRequest("a deterministic request with temperature > 0 needs a seed: sampling is "
                             "reproducible only for a given seed (or set temperature to 0 for greedy)",
                             param="seed", code="seed_required")
        if kind == "chat":
            prompt = Prompt("chat", tuple({"role": m.role, "content": m.text()} for m in params.messages),
                            None, "http")
        else:
            prompt = params.prompt
        try:
            if isinstance(prompt, list):
                ids = prompt
            else:
                if isinstance(prompt, str):
                    prompt = Prompt("text", None, prompt, "http")
                ids = await run_in_threadpool(state.encode, prompt)
            room = state.engine.max_len - len(ids)  # < 1: the engine refuses the prompt, with its message
            max_tokens = params.tokens_limit()
            if max_tokens is None:
                max_tokens = max(1, min(config.default_max_tokens, room))
            elif room >= 1 and max_tokens > room:
                raise BadRequest(f"max_tokens={max_tokens} does not fit: the prompt has {len(ids)} tokens and the "
                                 f"context {state.engine.max_len} positions, so at most {room} new tokens",
                                 param="max_completion_tokens" if kind == "chat" and
                                 params.max_completion_tokens is not None else "max_tokens")
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            request = Request(list(ids), max_tokens, policy, ignore_eos=params.ignore_eos, request_id=rid,
                              temperature=temperature, seed=params.seed)
        except BadRequest:
            raise
        except ValueError as exc:
            raise BadRequest(str(exc), param="messages" if kind == "chat" else "prompt") from None
        return Job(kind, params, request, policy, deterministic, rid)

    async def wait_disconnect(req: HTTPRequest) -> None:
        while True:
            message = await req.receive()
            if message["type"] == "http.disconnect":
                return

    async def next_event(handle: Handle) -> tuple[str, Any]:
        return await handle.events.get()

    async def run_job(job: Job, handle: Handle, assembler: TextAssembler) -> AsyncIterator[tuple]:
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

    def envelope(job: Job) -> dict:
        return {"id": job.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": state.model_id, "system_fingerprint": state.fingerprint}

    def usage(job: Job, completion_tokens: int) -> dict:
        n = len(job.request.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}

    async def complete(job: Job, handle: Handle, req: HTTPRequest) -> Response:
        assembler = TextAssembler(state.decode, job.params.stop_strings)

        async def collect():
            parts, ids, final = [], [], None
            async for ev in run_job(job, handle, assembler):
                if ev[0] == "delta":
                    parts.append(ev[1])
                    ids += ev[2]
                else:
                    final = ev
            return "".join(parts), ids, final

        task = asyncio.ensure_future(collect())
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
        body = envelope(job)
        choice = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": ids}
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body.update(choices=[choice], usage=usage(job, len(ids)), determinism=determinism_report(state, job, result))
        return JSONResponse(body)

    def sse(obj: dict) -> bytes:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    async def stream(job: Job, handle: Handle) -> AsyncIterator[bytes]:
        assembler = TextAssembler(state.decode, job.params.stop_strings)
        include_usage = bool(job.params.stream_options and job.params.stream_options.include_usage)
        base = envelope(job)
        base["object"] = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        n_ids, finished = 0, False

        def chunk(text: str | None, ids: list[int], reason: str | None = None, first: bool = False) -> dict:
            c: dict = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": ids}
            if job.kind == "chat":
                delta: dict = {"role": "assistant"} if first else {}
                if text is not None:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"] = text or ""
            return {**base, "choices": [c]}

        try:
            if job.kind == "chat":
                yield sse(chunk("", [], first=True))
            async for ev in run_job(job, handle, assembler):
                if ev[0] == "delta":
                    n_ids += len(ev[2])
                    yield sse(chunk(ev[1], ev[2]))
                else:
                    _, reason, result = ev
                    final = chunk(None if job.kind == "chat" else "", [], reason)
                    final["determinism"] = determinism_report(state, job, result)
                    if not include_usage:
                        final["usage"] = usage(job, n_ids)
                    yield sse(final)
                    if include_usage:
                        yield sse({**base, "choices": [], "usage": usage(job, n_ids)})
            finished = True
            yield b"data: [DONE]\n\n"
        except RequestFailed as exc:
            finished = True
            kind = "server_error" if exc.status >= 500 else "invalid_request_error"
            yield sse(error_body(exc.message, kind, code=str(exc.status)))
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the server cancelled us): free the slot now
                state.worker.abort(handle, "disconnect")

    async def generate(req: HTTPRequest, kind: str) -> Response:
        try:
            job = await parse(req, kind)
        except BadRequest as exc:
            state.metrics.inc("requests_rejected_total", reason="invalid" if exc.status < 500 else "error")
            return json_error(exc.status, exc.message, param=exc.param, code=exc.code)
        retry = {"Retry-After": str(config.retry_after_s)}
        try:
            handle = state.worker.submit(job.request)
        except QueueFull as exc:
            state.metrics.inc("requests_rejected_total", reason="queue_full")
            return json_error(429, f"server busy: {exc}; retry later", code="queue_full", headers=retry)
        except ShuttingDown as exc:
            state.metrics.inc("requests_rejected_total", reason="unavailable")
            return json_error(503, str(exc), code="unavailable", headers=retry)
        handed_over = False
        try:
            kind_, payload = await next_event(handle)  # "accepted", or the engine refused it
            if kind_ == "error":
                status, message = payload
                return json_error(status, message, param="messages" if kind == "chat" else "prompt",
                                  code="engine_error" if status >= 500 else "invalid_request")
            if job.params.streaming:
                handed_over = True
                return EventStream(state.worker, handle, stream(job, handle))
            handed_over = True
            return await complete(job, handle, req)
        finally:
            if not handed_over:
                state.worker.abort(handle, "disconnect")

    @app.post("/v1/completions")
    async def completions(req: HTTPRequest):
        return await generate(req, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: HTTPRequest):
        return await generate(req, "chat")

    app.add_middleware(Guard, state=state)
    return app


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


class Guard:
    """ASGI middleware: API-key check (all routes but /health) and per-route request counts."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in ROUTES else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self._expected is not None and path != "/health":
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, self._expected):
                    response = json_error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                    return await response(scope, receive, send_wrapper)
            await self.app(scope, receive, send_wrapper)
        finally:
            self.state.metrics.inc("http_requests_total", route=route, code=str(status["code"]))
