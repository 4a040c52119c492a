"""Tool calls on chat completions with the `openai` client, on the embedded model (whose chat template has
no tool format: ours is used): `required` and a named function are enforced by the grammar, so they
always parse; bitwise the same alone and under load; streamed as tool-call deltas; `auto` (and no
tool_choice) answers; a forced call ends at its schema's properties; `required` ends after its calls;
`parallel_tool_calls: false` allows one; blocks that are no calls stay content behind a marker; an agent
loop (call, tool result, answer) under batch-invariant, bitwise the same twice."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, chat  # noqa: E402
from test_server_logprobs import Load  # noqa: E402

from margingate.server.core.tools import plan  # noqa: E402
from margingate.server.parsers import tool_format  # noqa: E402
from margingate.server.protocol.bodies import ChatCompletionRequest  # noqa: E402

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
                                       max_tokens=96, logprobs=True, extra_body=BI, **kw)
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


def test_auto_and_no_tool_choice_answer_on_a_template_without_a_tool_format(http):
    """LangChain's bind_tools sends no tool_choice, openai-agents sends auto after a call: both answered
    (they were a 400 here), the same answer, in text or calls."""
    answers = []
    for choice in ({}, {"tool_choice": "auto"}):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME],
                                                    "max_tokens": 24, **BI, **choice})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["message"]["content"] or c["message"].get("tool_calls")
        answers.append((c["token_ids"], c["message"]["content"]))
    assert answers[0] == answers[1]


def test_a_request_reads_its_tools_once_into_the_plan_its_job_carries(client, monkeypatch):
    """One plan per request (core/tools.py): the prompt's tool offer, the grammar and the parser of every choice
    (n = 2, streamed and whole) read it; nothing walks back to the body's tools."""
    from margingate.server.core import jobs, tools

    built, read, outcome = [], [], jobs.Job.outcome
    monkeypatch.setattr(tools, "plan", lambda *a: built.append(plan(*a)) or built[-1])
    monkeypatch.setattr(jobs.Job, "outcome", lambda job, whole: read.append(job.tools) or outcome(job, whole))
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, n=2,
                                       max_tokens=48, extra_body=BI)
    assert [c.message.tool_calls[0].function.name for c in r.choices] == ["get_weather"] * 2
    assert len(built) == 1 and read == [built[0]] * 2
    assert (built[0].mode, [t.function.name for t in built[0].offered], built[0].max_calls) == ("named",
                                                                                               ["get_weather"], 1)


def test_bad_tool_requests_name_the_field(http):
    for body, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice.function.name"), ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools")):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


# The issue's example: a schema that does not say additionalProperties (JSON Schema's default is open).
LOCATION = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}


def test_a_forced_call_holds_its_schemas_properties_only_and_ends(client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[LOCATION], tool_choice=choice,
                                           max_tokens=160, extra_body=BI)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and r.usage.completion_tokens < 160, (choice, c)
        assert [json.loads(t.function.arguments).keys() for t in c.message.tool_calls] == [{"location"}]


def test_required_ends_after_its_calls(client):
    """At most one call per tool offered (the grammar's bound, checked below, is what a model that would
    repeat its calls meets; the embedded model's greedy answer here ends by itself)."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=240, extra_body=BI)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and 1 <= len(c.message.tool_calls) <= 2 and r.usage.completion_tokens < 240


def test_parallel_tool_calls_false_allows_exactly_one_call(client, llm):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=96, extra_body=BI)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    calls = [tool_format.block("get_weather", {"city": "Paris"}), tool_format.block("get_time", {"zone": "UTC"}),
             tool_format.block("get_weather", {"city": "Rome"})]
    for parallel, limit in ((False, 1), (None, 2)):  # the grammar itself: one call, or one per tool
        params = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME],
                                                       "tool_choice": "required", "parallel_tool_calls": parallel})
        for k in (1, 2, 3):
            matcher = llm.grammars.matcher(plan(params, None).constraint)
            ids = llm.tokenizer.encode("\n".join(calls[:k]))
            assert all(matcher.ll.consume_token(t) for t in ids) == (k <= limit), (parallel, k)


def test_blocks_that_are_no_calls_stay_content_behind_a_marker():
    params = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME]})
    good = tool_format.block("get_time", {"zone": "UTC"})
    bad = ['<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',   # not JSON
           tool_format.block("launch_rockets", {}),                                     # not a tool offered
           '<tool_call>\n{"arguments": {}}\n</tool_call>',                             # no name
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa']            # cut short
    content, calls = plan(params, None).parse("Sure.\n" + "\n".join([bad[0], good, *bad[1:]]))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_time",
                                                                                                 {"zone": "UTC"})]
    assert content.startswith("Sure.") and content.count("[margingate: not a tool call") == len(bad)
    assert all(b in content for b in bad) and good not in content
    assert plan(params, None).parse('{"zone": "CET"') == ('{"zone": "CET"', [])  # no block: the text as it came


def test_string_arguments_are_not_encoded_twice():
    params = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [TIME]})
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>'
    _, calls = plan(params, None).parse(text)
    assert calls[0]["function"]["arguments"] == '{"zone": "UTC"}'


def test_closing_a_schema_keeps_what_it_says():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                                               "c": {"type": "object", "properties": {}, "additionalProperties": True}},
              "$defs": {"d": {"properties": {"e": {}}}}, "anyOf": [{"properties": {"f": {}}}]}
    out = tool_format.closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["additionalProperties"] is True and "additionalProperties" not in schema
    assert out["$defs"]["d"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is False
    assert tool_format.closed({"type": "object"}) == {"type": "object"}  # lists no properties: any object


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
    params = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [TIME]})
    content, calls = plan(params, None).parse(text)
    assert content == "Sure." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_time", {"zone": "UTC"})]


def test_a_call_written_as_a_fenced_json_object_is_a_call():
    """Qwen2.5-Coder's shape in `auto`: the call as a JSON object in a ```json fence (or the whole answer);
    the text around it stays content, and JSON that is not exactly an offered call stays text, unmarked."""
    params = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME]})
    fenced = 'I will look it up.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    content, calls = plan(params, None).parse(fenced)
    assert content == "I will look it up."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    _, calls = plan(params, None).parse('{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    for text in ('```json\n{"name": "launch_rockets", "arguments": {}}\n```',     # not offered
                 '```json\n{"name": "get_time", "arguments": {}, "why": 1}\n```',  # more than a call
                 '```python\nprint(1)\n```', '{"zone": "CET"'):
        assert plan(params, None).parse(text) == (text, [])
    one = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME],
                                                "parallel_tool_calls": False})
    two = fenced + '\n```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```'
    content, calls = plan(one, None).parse(two)
    assert len(calls) == 1 and content.endswith('{"name": "get_time", "arguments": {"zone": "UTC"}}\n```')


def test_a_forced_call_names_the_markers_a_tokenizer_has_as_one_token(model_dir):
    """Qwen's tokenizers have `<tool_call>` and `</tool_call>` as added tokens, which the model writes and
    llguidance reads as special: its mask offers the token where the grammar spells the text, then refuses
    it, and a forced call ended after `<tool_call>`. Here the embedded tokenizer with the two added."""
    from transformers import AutoTokenizer

    from margingate.engine.structured import Grammars

    hf = AutoTokenizer.from_pretrained(model_dir)
    hf.add_tokens([tool_format.OPEN, tool_format.CLOSE])

    class WithMarkers:  # transformers' tokenizer with the two added, read as Grammars reads ours
        eos_token_id = hf.eos_token_id

        def backend_json(self):
            return hf.backend_tokenizer.to_str()

        def encode(self, text):
            return hf.encode(text, add_special_tokens=False)

    grammars = Grammars(WithMarkers(), len(hf))
    assert grammars.is_special(tool_format.OPEN) and not grammars.is_special("get_weather")
    params = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    ids = hf.encode(tool_format.block("get_weather", {"city": "Paris"}), add_special_tokens=False)
    assert hf.convert_ids_to_tokens([ids[0], ids[-1]]) == [tool_format.OPEN, tool_format.CLOSE]
    named = grammars.matcher(plan(params, "hermes", grammars).constraint).ll
    assert all(named.consume_token(t) for t in ids) and named.is_accepting()
    spelled = grammars.matcher(plan(params, "hermes").constraint).ll
    assert not spelled.consume_token(ids[0])  # the failure: spelled, the marker's own token is refused
