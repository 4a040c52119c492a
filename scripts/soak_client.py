"""The soak's HTTP side (scripts/soak.py): one request, streamed or not, read into an `Answer` whose parts
(token ids, text, tool calls, logprobs, finish reason) are compared with the request's alone-run."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx


@dataclass
class Answer:
    """One response, streamed or not, in one shape: what must equal the alone-run (`key`) and the rest."""
    status: int | None = None
    ids: list = field(default_factory=list)
    text: str = ""
    calls: dict = field(default_factory=dict)  # tool call index -> [name, arguments]
    logprobs: list = field(default_factory=list)
    finish: str | None = None
    report: dict | None = None
    done: bool = False
    error: str | None = None

    def add(self, choice: dict, streamed: bool) -> None:
        """A whole answer's choice, or a stream chunk's."""
        self.ids += choice.get("token_ids") or []
        part = choice.get("delta" if streamed else "message") or {}
        self.text += choice.get("text") or part.get("content") or ""
        for i, call in enumerate(part.get("tool_calls") or []):
            entry = self.calls.setdefault(str(call.get("index", i)), ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
        lp = choice.get("logprobs") or {}
        self.logprobs += lp.get("token_logprobs") or [t["logprob"] for t in lp.get("content") or []]
        self.finish = choice.get("finish_reason") or self.finish

    def key(self) -> tuple:
        return self.ids, self.text, self.calls, self.logprobs, self.finish

    def differs(self, other: Answer) -> str:
        """The parts of `key` where the two answers differ."""
        names = ("ids", "text", "tool calls", "logprobs", "finish reason")
        return ", ".join(n for n, a, b in zip(names, self.key(), other.key()) if a != b)


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
        a.add(data["choices"][0], streamed=False)
        a.report, a.done = data.get("determinism"), True
    return a


async def stream(client: httpx.AsyncClient, path: str, body: dict, cancel_after: int | None = None) -> Answer:
    """A streamed request; with `cancel_after`, the connection is closed once that many tokens came."""
    a = Answer()
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
                ev = json.loads(line[6:])
                a.error = ev["error"].get("message") if "error" in ev else a.error
                for c in ev.get("choices", []):
                    a.add(c, streamed=True)
                a.report = ev.get("determinism") or a.report
                if cancel_after is not None and len(a.ids) >= cancel_after:
                    return a  # leaving the block closes the connection: the server must free the slot
    except httpx.HTTPError as exc:
        a.error = f"{type(exc).__name__}: {exc}"
    return a


GAUGES = ("prefix_cache_tokens", "heap_trims_total", "heap_released_bytes_total")


async def gauges(client: httpx.AsyncClient) -> dict:
    """The server's GAUGES from /metrics (the prefix cache's positions, the idle heap trims)."""
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name.removeprefix("margingate_") in GAUGES:
            values[name.removeprefix("margingate_")] = float(value)
    return values
