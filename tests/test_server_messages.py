"""`POST /v1/messages` (Anthropic's Messages API) with plain httpx requests (the anthropic SDK is not a test
dependency), on the embedded model: served as a chat completion, so each answer is bitwise the chat route's for
the same conversation (system, text, a tool_use and its tool_result sent back); a forced tool is a `tool_use`
block whose input has the schema's properties; streamed, the events come in Anthropic's order and their text
and `input_json_delta` fragments are the whole answer's, bitwise, under every deterministic policy; refusals
name the Messages field, and every error on the route is Anthropic's body (`{"type": "error", "error": {"type",
"message"}}`) with the status the other routes answer, which keep OpenAI's; Anthropic's `x-api-key` header is an
API key."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from server_fixtures import MODEL, chat, make_server  # noqa: E402

from margingate.options import deterministic_policies  # noqa: E402

BI = {"determinism": {"policy": "batch-invariant"}}
ASK = "What is the weather in Paris?"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 96}


def message(http, messages, **kw) -> dict:
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 24, "messages": messages, **BI, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def chat_message(http, messages, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 24, "messages": messages, **BI, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def events(http, body: dict) -> list[tuple[str, dict]]:
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]
    return list(zip(names, data))


def test_a_text_answer_is_the_chat_answer(http):
    system = "Answer briefly."
    m = message(http, [{"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]}],
                system=system)
    c = chat_message(http, [{"role": "system", "content": system}, *chat("Why is the sky blue?")])
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert [b["type"] for b in m["content"]] == ["text"] and m["content"][0]["text"] == c["message"]["content"]
    assert m["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[c["finish_reason"]]
    assert m["usage"]["output_tokens"] == len(c["token_ids"]) and m["usage"]["input_tokens"] > 0
    assert m["determinism"]["deterministic"] is True


def test_a_forced_tool_is_a_tool_use_block_and_its_result_answers_as_chat_does(http):
    first = message(http, [{"role": "user", "content": ASK}], **FORCED)
    [use] = first["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and set(use["input"]) == {"city"}
    assert first["stop_reason"] == "tool_use"
    forced = chat_message(http, chat(ASK), tools=[CHAT_WEATHER], max_tokens=96,
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(forced["message"]["tool_calls"][0]["function"]["arguments"]) == use["input"]
    second = message(http, [{"role": "user", "content": ASK}, {"role": "assistant", "content": first["content"]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                          "content": "sunny, 21 C"}]}],
                     tools=[WEATHER], max_tokens=48)
    call = {"id": use["id"], "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps(use["input"])}}
    c = chat_message(http, [*chat(ASK), {"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": use["id"], "content": "sunny, 21 C"}],
                     tools=[CHAT_WEATHER], max_tokens=48)
    text = [b["text"] for b in second["content"] if b["type"] == "text"]
    uses = [(b["name"], b["input"]) for b in second["content"] if b["type"] == "tool_use"]
    assert (text[0] if text else None) == c["message"]["content"]
    assert uses == [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                    for t in c["message"].get("tool_calls") or []]


def check_order(stream: list[tuple[str, dict]]) -> None:
    names = [n for n, _ in stream]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["index"] for n, d in stream if n == "content_block_start"]
    stops = [d["index"] for n, d in stream if n == "content_block_stop"]
    assert starts == stops == list(range(len(starts))) and starts  # one block at a time, in order
    for n, d in stream:
        if n == "content_block_delta":
            assert starts.index(d["index"]) >= 0


@pytest.mark.parametrize("policy", [p if p == "batch-invariant" else pytest.param(p, marks=pytest.mark.slow)
                                    for p in deterministic_policies() if p != "auto"])
def test_a_stream_is_the_whole_message_bitwise(http, policy):
    body = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "determinism": {"policy": policy},
            **FORCED}
    whole = http.post("/v1/messages", json=body).json()
    stream = events(http, body)
    check_order(stream)
    fragments = [d["delta"]["partial_json"] for n, d in stream if n == "content_block_delta"]
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in stream if n == "content_block_delta")
    assert json.loads("".join(fragments)) == whole["content"][0]["input"]
    forced = chat_message(http, chat(ASK), tools=[CHAT_WEATHER], max_tokens=96, determinism={"policy": policy},
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "".join(fragments) == forced["message"]["tool_calls"][0]["function"]["arguments"]  # the text, bitwise
    start = [d["content_block"] for n, d in stream if n == "content_block_start"][0]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    delta = stream[-2][1]
    assert delta["delta"]["stop_reason"] == whole["stop_reason"] == "tool_use"
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    text_body = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
                 "determinism": {"policy": policy}}
    text = http.post("/v1/messages", json=text_body).json()["content"][0]["text"]
    stream = events(http, text_body)
    check_order(stream)
    assert "".join(d["delta"]["text"] for n, d in stream if n == "content_block_delta") == text


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"temperature": 0.7, "deterministic": True}, "seed"),
])
def test_bad_requests_name_the_messages_field(http, extra, param):
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = http.post("/v1/messages", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert set(r.json()) == {"type", "error"} and r.json()["error"]["message"]


def test_anthropics_api_key_header_is_a_key(llm):
    import httpx

    srv = make_server(llm, slots=2, api_key="sesame")
    try:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=srv.url, timeout=120) as h:
            assert h.post("/v1/messages", json=body).status_code == 401
            refused = h.post("/v1/messages", json=body).json()
            assert refused == {"type": "error", "error": {"type": "authentication_error", "message": refused["error"][
                "message"]}} and refused["error"]["message"].startswith("missing or invalid API key")
            assert "type" not in h.post("/v1/chat/completions", json=body).json()  # OpenAI's shape there
            assert h.post("/v1/messages", json=body, headers={"x-api-key": "wrong"}).status_code == 401
            assert h.post("/v1/messages", json=body, headers={"x-api-key": "sesame"}).status_code == 200
            assert h.post("/v1/messages", json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200
    finally:
        srv.stop()


def test_errors_on_the_messages_route_are_anthropics_and_other_routes_keep_openais(http):
    """The error body each API's clients read: the engine's refusal of a prompt too long, a method the route has
    not, a body that is not JSON; the same refusal on chat completions in OpenAI's shape."""
    long = [{"role": "user", "content": "word " * 600}]  # past the test server's 512 positions
    cases = [(http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": long}), 400,
              "invalid_request_error"),
             (http.get("/v1/messages"), 405, "invalid_request_error"),
             (http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"}), 400,
              "invalid_request_error")]
    for r, status, kind in cases:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "messages": long})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert {"message", "type", "param", "code"} <= set(r.json()["error"]) and r.json()["error"]["type"] == \
        "invalid_request_error"


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (422, "invalid_request_error"), (429, "rate_limit_error"),
                                          (500, "api_error"), (503, "overloaded_error")])
def test_each_status_has_anthropics_error_type(status, kind):
    from margingate.server.protocol.errors import route_error

    r = route_error("/v1/messages", status, "why", headers={"Retry-After": "1"})
    assert r.status_code == status and r.headers["retry-after"] == "1"
    assert json.loads(r.body) == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert json.loads(route_error("/v1/chat/completions", status, "why").body)["error"]["message"] == "why"
