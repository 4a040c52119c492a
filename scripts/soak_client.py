"""The soak's HTTP side (scripts/soak.py): one request, streamed or not, read into an `Answer` whose parts
(token ids and their count, text, tool calls, logprobs, finish reason) are compared with the request's alone-run.
Chat and completions answers are read from their choices (whole) or chunks (streamed); a Responses answer from
its output items (whole) or its events (streamed), with its text's logprobs where asked for; it carries no token
ids: its count of output tokens stands in for them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

# the events that end a Responses stream, with the final Response in them
RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


@dataclass
class Answer:
    """One response, streamed or not, in one shape: what must equal the alone-run (`key`) and the rest."""
    status: int | None = None
    ids: list = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    calls: dict = field(default_factory=dict)  # tool call index -> [name, arguments]
    logprobs: list = field(default_factory=list)
    finish: str | None = None
    report: dict | None = None
    done: bool = False
    error: str | None = None
    items: dict = field(default_factory=dict)  # a streamed Response: a call's item id -> its index in `calls`

    def call(self, index: str, name: str, arguments: str) -> None:
        """A tool call, or a fragment of one: its name and arguments grow as they come."""
        entry = self.calls.setdefault(index, ["", ""])
        entry[0] += name
        entry[1] += arguments

    def add(self, choice: dict, streamed: bool) -> None:
        """A whole chat or completions answer's choice, or a stream chunk's."""
        self.ids += choice.get("token_ids") or []
        self.tokens = len(self.ids)
        part = choice.get("delta" if streamed else "message") or {}
        self.text += choice.get("text") or part.get("content") or ""
        for i, call in enumerate(part.get("tool_calls") or []):
            self.call(str(call.get("index", i)), call["function"].get("name") or "",
                      call["function"].get("arguments") or "")
        lp = choice.get("logprobs") or {}
        self.logprobs += lp.get("token_logprobs") or logprob_values(lp.get("content"))
        self.finish = choice.get("finish_reason") or self.finish

    def add_response(self, response: dict) -> None:
        """A whole Response: its message text (and its logprobs) and function calls in output order, its status as
        the finish reason, its output tokens and report."""
        for item in response.get("output") or []:
            if item["type"] == "message":
                self.text += "".join(part.get("text", "") for part in item["content"])
                self.logprobs += [x for part in item["content"] for x in logprob_values(part.get("logprobs"))]
            elif item["type"] == "function_call":
                self.call(str(len(self.calls)), item["name"], item["arguments"])
        details = response.get("incomplete_details") or {}
        self.finish = "/".join(filter(None, (response.get("status"), details.get("reason"))))
        self.tokens = (response.get("usage") or {}).get("output_tokens", 0)
        self.report = response.get("determinism")
        self.error = (response.get("error") or {}).get("message") or self.error

    def add_event(self, ev: dict) -> None:
        """One event of a streamed Response: text (with its logprobs) and argument deltas build the answer; the
        last event's Response gives its finish, count and report, and its output must be what the deltas built."""
        kind = ev.get("type")
        if kind == "response.output_text.delta":
            self.text += ev["delta"]
            self.logprobs += logprob_values(ev.get("logprobs"))
        elif kind == "response.output_item.added" and ev["item"]["type"] == "function_call":
            self.items[ev["item"]["id"]] = str(len(self.calls))
            self.call(self.items[ev["item"]["id"]], ev["item"]["name"], ev["item"].get("arguments") or "")
        elif kind == "response.function_call_arguments.delta":
            self.call(self.items[ev["item_id"]], "", ev["delta"])
        elif kind in RESPONSE_ENDS:
            whole = Answer()
            whole.add_response(ev["response"])
            self.finish, self.tokens, self.report = whole.finish, whole.tokens, whole.report
            self.error = whole.error or self.error
            if (whole.text, whole.calls, whole.logprobs) != (self.text, self.calls, self.logprobs):
                self.error = f"the deltas differ from {kind}'s output"
            self.done = kind != "response.failed"

    def key(self) -> tuple:
        return self.ids, self.tokens, self.text, self.calls, self.logprobs, self.finish

    def differs(self, other: Answer) -> str:
        """The parts of `key` where the two answers differ."""
        names = ("ids", "token count", "text", "tool calls", "logprobs", "finish reason")
        return ", ".join(n for n, a, b in zip(names, self.key(), other.key()) if a != b)


def logprob_values(entries: list[dict] | None) -> list[float]:
    """The logprobs of chat's `content` entries, or of a Responses text's (the same shape)."""
    return [t["logprob"] for t in entries or []]


def is_responses(path: str) -> bool:
    return path.endswith("/responses")


async def post(client: httpx.AsyncClient, path: str, body: dict | bytes) -> Answer:
    a = Answer()
    try:
        r = await (client.post(path, content=body, headers={"content-type": "application/json"})
                   if isinstance(body, bytes) else client.post(path, json=body))
    except httpx.HTTPError as exc:
        a.error = f"{type(exc).__name__}: {exc}"
        return a
    a.status = r.status_code
    if r.status_code == 200:
        data = r.json()
        if is_responses(path):
            a.add_response(data)
        else:
            a.add(data["choices"][0], streamed=False)
            a.report = data.get("determinism")
        a.done = True
    return a


def read_chunk(a: Answer, ev: dict) -> None:
    """One chat or completions chunk."""
    a.error = ev["error"].get("message") if "error" in ev else a.error
    for c in ev.get("choices", []):
        a.add(c, streamed=True)
    a.report = ev.get("determinism") or a.report


async def stream(client: httpx.AsyncClient, path: str, body: dict, cancel_after: int | None = None) -> Answer:
    """A streamed request; with `cancel_after`, the connection is closed once that many tokens came."""
    a, read = Answer(), (Answer.add_event if is_responses(path) else read_chunk)
    try:
        async with client.stream("POST", path, json={**body, "stream": True}) as r:
            a.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return a
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    a.done = True
                    break
                read(a, json.loads(line[6:]))
                if cancel_after is not None and len(a.ids) >= cancel_after:
                    return a  # leaving the block closes the connection: the server must free the slot
    except httpx.HTTPError as exc:
        a.error = f"{type(exc).__name__}: {exc}"
    return a


GAUGES = ("prefix_cache_tokens", "heap_trims_total", "heap_released_bytes_total", "kv_preemptions")


async def gauges(client: httpx.AsyncClient) -> dict:
    """The server's GAUGES from /metrics (the prefix cache's positions, the idle heap trims, the preemptions)."""
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name.removeprefix("margingate_") in GAUGES:
            values[name.removeprefix("margingate_")] = float(value)
    return values
