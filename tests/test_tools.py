"""Tool calls on chat completions with the `openai` client: `required` and a named function are
enforced by the grammar, so they always parse; bitwise the same alone and under load; streamed as
tool-call deltas; `auto` is a 400 on a model whose chat template has no tool format; an agent loop
(call, tool result, answer) under batch-invariant, bitwise the same twice."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, chat  # noqa: E402
from test_server_logprobs import Load  # noqa: E402

from margingate.server.formats import NamedToolChoice  # noqa: E402
from margingate.server.tools import parse  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
BI = {"determinism": {"policy": "batch-invariant"}}
ASK = chat("What is the weather in Paris?")


def call(client, tool_choice, messages=ASK, **kw):
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                       max_tokens=48, logprobs=True, extra_body=BI, **kw)
    c = r.choices[0]
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls or []]
    return c.finish_reason, calls, c.model_extra["token_ids"], [t.logprob for t in c.logprobs.content]


def test_forced_calls_parse_and_are_bitwise_the_same_under_load(client, server):
    named = call(client, {"type": "function", "function": {"name": "get_weather"}})
    required = call(client, "required")
    assert named[0] == "tool_calls" and named[1][0][0] == "get_weather" and set(named[1][0][1]) == {"city"}
    assert required[0] == "tool_calls" and required[1] and all(n in ("get_weather", "get_time") for n, _ in required[1])
    with Load(server, 8):
        assert call(client, {"type": "function", "function": {"name": "get_weather"}}) == named
        assert call(client, "required") == required


def test_tool_calls_stream_as_deltas(client):
    named = call(client, {"type": "function", "function": {"name": "get_weather"}})
    calls, reason = {}, None
    for ev in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=48,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                             stream=True, extra_body=BI):
        for c in ev.choices:
            reason = c.finish_reason or reason
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == named[1]


def test_auto_needs_a_template_with_a_tool_format(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "template" in r.json()["error"]["message"]
    for body, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice.function.name"), ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools")):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def agent_loop(client):
    """Call a tool, send its result back (role: tool), get the answer."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=48,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           extra_body=BI)
    tool_call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
                {"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=24, extra_body=BI)
    a = answer.choices[0]
    return (tool_call.function.name, tool_call.function.arguments, first.choices[0].model_extra["token_ids"],
            a.message.content, a.model_extra["token_ids"], a.finish_reason)


def test_an_agent_loop_is_bitwise_the_same_twice(client):
    once = agent_loop(client)
    assert once[0] == "get_weather" and once[3] and once[5] in ("stop", "length")
    assert agent_loop(client) == once


def test_hermes_blocks_parse_into_calls():
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'

    class Params:
        tool_choice = NamedToolChoice(type="function", function={"name": "get_time"})

    content, calls = parse(text, Params, "auto")
    assert content == "Sure." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_time", {"zone": "UTC"})]
    assert parse('{"zone": "CET"', Params, "named") == ('{"zone": "CET"', [])  # cut short: stays content
