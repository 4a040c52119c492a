"""Logprobs on `POST /v1/responses` (`top_logprobs`, `include: ["message.output_text.logprobs"]`), on the embedded
model: the output_text carries one entry per token, the chat route's entries for the same messages bitwise; the
streamed deltas' logprobs joined are the whole answer's bitwise; `top_logprobs` entries per token as asked; a bad
`top_logprobs` is a 400 naming it; without either, `logprobs` stays `[]`; the openai SDK reads them typed."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, chat  # noqa: E402

BI = {"determinism": {"policy": "batch-invariant"}}
ASK = "Why is the sky blue?"
INCLUDE = ["message.output_text.logprobs"]


def respond(http, **kw) -> dict:
    r = http.post("/v1/responses", json={"model": MODEL, "input": ASK, "max_output_tokens": 24, **BI, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def text_part(body: dict) -> dict:
    [message] = [i for i in body["output"] if i["type"] == "message"]
    return message["content"][0]


def stream_events(http, **kw) -> list[dict]:
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 24, "stream": True, **BI, **kw}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_the_text_carries_the_chat_routes_logprobs_bitwise(http):
    whole = respond(http, top_logprobs=2, include=INCLUDE)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat(ASK), "max_tokens": 24,
                                                "logprobs": True, "top_logprobs": 2, **BI})
    [choice] = r.json()["choices"]
    part = text_part(whole)
    assert part["text"] == choice["message"]["content"]
    assert len(part["logprobs"]) == whole["usage"]["output_tokens"] == len(choice["token_ids"]) > 1
    assert json.dumps(part["logprobs"]) == json.dumps(choice["logprobs"]["content"])


def test_the_streamed_deltas_logprobs_are_the_whole_answers_bitwise(http):
    ask = {"top_logprobs": 2, "include": INCLUDE}
    whole = text_part(respond(http, **ask))
    events = stream_events(http, **ask)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    joined = [lp for e in deltas for lp in e["logprobs"]]
    assert sum(1 for e in deltas if e["logprobs"]) > 1   # they come with their text, not all at the end
    assert "".join(e["delta"] for e in deltas) == whole["text"]
    final = text_part(events[-1]["response"])
    assert json.dumps(joined) == json.dumps(done["logprobs"]) == json.dumps(final["logprobs"]) \
        == json.dumps(whole["logprobs"])


@pytest.mark.parametrize("ask, top", [({"include": INCLUDE}, 0), ({"top_logprobs": 1}, 1),
                                      ({"top_logprobs": 5, "include": INCLUDE}, 5)])
def test_top_logprobs_gives_that_many_per_token(http, ask, top):
    logprobs = text_part(respond(http, **ask))["logprobs"]
    assert logprobs and all(len(lp["top_logprobs"]) == top for lp in logprobs)
    assert all(set(lp) == {"token", "bytes", "logprob", "top_logprobs"} for lp in logprobs)
    if top:   # the likeliest alternative of a greedy answer is its own token
        assert all(lp["top_logprobs"][0]["logprob"] == lp["logprob"] for lp in logprobs)


def test_without_asking_the_text_has_no_logprobs(http):
    assert text_part(respond(http, top_logprobs=0, include=[]))["logprobs"] == []
    events = stream_events(http)
    assert all(e["logprobs"] == [] for e in events if e["type"] in ("response.output_text.delta",
                                                                    "response.output_text.done"))


@pytest.mark.parametrize("value", [21, -1, "2", 2.5])
def test_a_bad_top_logprobs_is_refused_by_name(http, value):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "top_logprobs": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_logprobs", r.json()


def test_the_sdk_reads_them_typed(client):
    from openai.types.responses.response_output_text import Logprob

    ask = dict(model=MODEL, input=ASK, max_output_tokens=16, top_logprobs=2, include=INCLUDE, extra_body=BI)
    r = client.responses.create(**ask)
    logprobs = r.output[0].content[0].logprobs
    assert logprobs and all(isinstance(lp, Logprob) and len(lp.top_logprobs) == 2 for lp in logprobs)
    assert all(lp.bytes for lp in logprobs)
    with client.responses.stream(**ask) as s:
        streamed = [lp for e in s if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in logprobs]
