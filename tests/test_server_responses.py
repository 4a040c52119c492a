"""`POST /v1/responses` through the openai client, on the embedded model: served as a chat completion, so each
answer is bitwise the chat route's for the same conversation (a string input, message items, instructions, a
function call and its output sent back); json_schema text format parses; a forced function call is a
`function_call` item whose arguments parse; streamed (`responses.stream`) the events come in the SDK's order
and their text and arguments are the whole answer's (bitwise under every deterministic policy, beside three
streaming clients); bad requests are a 400 naming the Responses field."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, StreamingLoad, chat  # noqa: E402

from margingate.options import deterministic_policies  # noqa: E402
from margingate.server.api.responses_request import SHARED  # noqa: E402
from margingate.server.protocol.bodies import ChatCompletionRequest  # noqa: E402

BI = {"determinism": {"policy": "batch-invariant"}}
ASK = "What is the weather in Paris?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
CITY = {"type": "json_schema", "name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
    "additionalProperties": False}}


def respond(client, input, **kw):
    kw.setdefault("max_output_tokens", 24)
    return client.responses.create(model=MODEL, input=input, extra_body=BI, **kw)


def chat_text(client, messages, **kw):
    kw.setdefault("max_tokens", 24)
    r = client.chat.completions.create(model=MODEL, messages=messages, extra_body=BI, **kw)
    return r.choices[0].message


def calls(response) -> list[tuple[str, dict]]:
    return [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]


def test_a_string_and_message_items_answer_as_chat_does(client):
    text = respond(client, "Why is the sky blue?")
    items = respond(client, [{"role": "user", "content": [{"type": "input_text", "text": "Why is the sky blue?"}]}])
    assert text.object == "response" and text.id.startswith("resp_") and text.status in ("completed", "incomplete")
    assert [i.type for i in text.output] == ["message"] and text.output_text
    assert text.output_text == items.output_text == chat_text(client, chat("Why is the sky blue?")).content
    u = text.usage
    assert u.input_tokens == items.usage.input_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert text.model_extra["determinism"]["deterministic"] is True
    assert text.model_extra["determinism"]["policy"] == "batch-invariant"


def test_instructions_are_the_system_message(client):
    r = respond(client, "Name a colour.", instructions="Answer in one word.")
    system = [{"role": "system", "content": "Answer in one word."}, *chat("Name a colour.")]
    assert r.instructions == "Answer in one word."
    assert r.output_text == chat_text(client, system).content
    assert r.output_text != respond(client, "Name a colour.").output_text


def test_json_schema_text_format_parses(client):
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    ask = "Which city is the capital of France? Answer in JSON."
    r = respond(client, ask, text={"format": CITY}, max_output_tokens=64)
    assert r.status == "completed"
    assert set(json.loads(r.output_text)) == {"city"}
    parsed = client.responses.parse(model=MODEL, input=ask, text_format=City, max_output_tokens=64, extra_body=BI)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.city


def forced_call(client):
    return respond(client, ASK, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   max_output_tokens=96)


def test_a_forced_function_call_is_a_function_call_item(client):
    r = forced_call(client)
    [item] = r.output
    assert item.type == "function_call" and item.call_id and item.status == "completed"
    assert calls(r)[0][0] == "get_weather" and set(calls(r)[0][1]) == {"city"}
    assert calls(forced_call(client)) == calls(r)


def test_a_function_call_output_answers_as_the_chat_tool_loop_does(client):
    first = forced_call(client)
    [call] = first.output
    second = respond(client, [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
                              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
                     tools=[WEATHER], tool_choice="auto", max_output_tokens=48)
    messages = [*chat(ASK), {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    m = chat_text(client, messages, tools=[CHAT_WEATHER], tool_choice="auto", max_tokens=48)
    assert second.output and second.status in ("completed", "incomplete")
    assert calls(second) == [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    said = [i for i in second.output if i.type == "message"]
    assert (said[0].content[0].text if said else None) == m.content


def streamed(client, body=BI, **kw) -> tuple[list, object]:
    with client.responses.stream(model=MODEL, extra_body=body, **kw) as s:
        events = list(s)
        return events, s.get_final_response()


def check_order(events) -> None:
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.count("response.output_item.added") == types.count("response.output_item.done") >= 1


@pytest.mark.parametrize("policy", [p for p in deterministic_policies() if p != "auto"])
def test_a_stream_is_the_whole_answer_bitwise_beside_streaming_clients(client, server, policy):
    body = {"determinism": {"policy": policy}}
    ask = dict(input="Which city is the capital of France? Answer in JSON.", text={"format": CITY},
               max_output_tokens=64)
    whole = client.responses.create(model=MODEL, extra_body=body, **ask)
    with StreamingLoad(server, 3, max_tokens=16):
        events, final = streamed(client, body, **ask)
    check_order(events)
    types = [e.type for e in events]
    for name in ("response.content_part.added", "response.output_text.done", "response.content_part.done"):
        assert types.count(name) == 1, name
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and types.count("response.output_text.delta") > 1
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.model_extra["determinism"]["policy"] == policy


def test_a_streamed_function_call_is_the_whole_call(client):
    events, final = streamed(client, input=ASK, tools=[WEATHER], max_output_tokens=96,
                             tool_choice={"type": "function", "name": "get_weather"})
    check_order(events)
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments == final.output[0].arguments
    assert calls(final) == calls(forced_call(client))


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(http):
    body = {"model": MODEL, "input": "Tell me a long story about rivers.", "max_output_tokens": 6, **BI}
    whole = http.post("/v1/responses", json=body).json()
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert whole["status"] == events[-1]["response"]["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"] and whole["usage"]["output_tokens"] == 6


@pytest.mark.parametrize("extra, param", [
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"instructons": "x"}, "instructons"),
    ({"background": True}, "background"),
])
def test_bad_requests_name_the_field(http, extra, param):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_fields_are_named_and_store_is_false(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "store": True,
                                         "include": [], "frobnicate": 1, **BI})
    assert r.status_code == 200, r.text
    assert r.headers["x-margingate-ignored-fields"] == "frobnicate"
    assert r.json()["store"] is False


def test_the_shared_fields_are_chat_fields():
    assert SHARED <= set(ChatCompletionRequest.model_fields)
