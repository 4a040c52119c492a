"""Streamed tool calls: a call's name goes out once read, then its arguments in fragments as the tokens arrive
(`call_parser.py`), with the `index` and `id` the openai SDK accumulates by. The parser gives every split of an
answer's text the whole answer's content and calls; on the server, under every deterministic policy and beside
three streaming clients, the fragments joined (by hand and by the SDK's `chat.completions.stream` helper, and
Responses' `function_call_arguments.delta` events) are bitwise the non-streamed call."""
from __future__ import annotations

import json
import random

import pytest

from margingate.server.parsers.call_parser import CallParser

NAMES = {"get_weather", "get_time"}
ANSWERS = [
    'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa ris", "n": [1, {"a": "}"}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call> done',
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>',   # a JSON string
    '<tool_call>\n{"arguments": {"zone": "UTC"}, "name": "get_time"}\n</tool_call>',             # read whole
    'I will look it up.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    '  {"name": "get_time", "parameters": {"zone": "UTC"}}\n',
    '{"zone": "CET"} is not a call',
    'Code:\n```python\nprint("<tool_call>")\n```\nand <b>bold</b> text ``` here',
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call> after',                # not offered
    # Qwen2.5-Coder-0.5B's own answers: its fenced call, and after a tool's result its call then the result
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    '{"name": "get_weather", "arguments": {"city": "London"}}\n{"forecast": "rain"}',
    'Checking.\n```\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```',                     # no json tag
]


def parsed(text: str, cuts: list[int] | None = None, whole: bool = False) -> tuple[list, str, list]:
    """(pieces, content, [(name, arguments)]) of `text` fed whole or split at `cuts`."""
    parser, pieces, start = CallParser(NAMES, 2, whole), [], 0
    for end in [*sorted(cuts or []), len(text)]:
        pieces += parser.feed(text[start:end])
        start = end
    pieces += parser.finish()
    content, calls = "", []
    for p in pieces:
        if p.kind == "text":
            content += p.text
        elif p.kind == "call":
            calls.append([p.name, ""])
        else:
            calls[p.index][1] += p.text
    return pieces, content, [tuple(c) for c in calls]


@pytest.mark.parametrize("text", ANSWERS)
def test_every_split_of_an_answer_gives_the_whole_answer(text):
    whole = parsed(text, whole=True)[1:]
    rng = random.Random(0)
    splits = [[i] for i in range(1, len(text))] + [rng.sample(range(1, len(text)), rng.randint(2, 24))
                                                    for _ in range(200)]
    for cuts in splits:
        assert parsed(text, cuts)[1:] == whole, cuts
    assert parsed(text, [1] + list(range(2, len(text))))[1:] == whole  # one character at a time


def test_a_fenced_or_bare_call_is_one_call_and_what_follows_a_bare_one_is_text():
    """The shapes a small model writes outside its template's blocks: a fence's call keeps its arguments as
    written (its spacing); a bare call followed by more (a model echoing its call, then the tool's result)
    is no call, so an agent loop ends on that text instead of calling again."""
    assert parsed(ANSWERS[9])[1:] == ("", [("get_weather", '{\n    "city": "Paris"\n  }')])
    assert parsed(ANSWERS[10])[1:] == (ANSWERS[10], [])
    assert parsed(ANSWERS[11])[1:] == ("Checking.", [("get_time", '{"zone": "UTC"}')])


def test_a_call_streams_its_name_then_its_arguments_before_the_block_closes():
    text = ANSWERS[0]
    cut = text.index('"UTC"') + 3
    parser = CallParser(NAMES, 2)
    early = parser.feed(text[:cut])
    assert [(p.kind, p.text, p.name) for p in early] == [("text", "Sure.", ""), ("call", "", "get_time"),
                                                         ("args", '{"zone": "UT', "")]
    late = parser.feed(text[cut:]) + parser.finish()
    assert [(p.kind, p.text) for p in late] == [("args", 'C"}')]


def test_the_arguments_are_as_the_model_wrote_them():
    """Bitwise the model's text (its spacing and escapes), not a re-encoding: what a stream can send as it comes."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone":"\\u00e9",  "x": 1.50}}\n</tool_call>'
    assert parsed(text, whole=True)[2] == [("get_time", '{"zone":"\\u00e9",  "x": 1.50}')]


def test_a_malformed_block_is_content_whole_and_a_call_as_far_as_it_streamed():
    """The one place the two differ (call_parser.py): a block cut off after its name was streamed."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    _, content, calls = parsed(text, whole=True)
    assert calls == [] and content.startswith("Sure.\n[margingate: not a tool call (no closing </tool_call>)]")
    assert parsed(text, [len(text) - 2])[1:] == ("Sure.", [("get_weather", '{"city": "Pa')])


# --- on the server ---------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, StreamingLoad, chat  # noqa: E402

from margingate.options import deterministic_policies  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
ASK = chat("What is the weather in Paris, in celsius?")
# every deterministic policy; beyond batch-invariant and margin, in the slow tier (the same check repeated)
POLICIES = [p if p in ("batch-invariant", "margin") else pytest.param(p, marks=pytest.mark.slow)
            for p in deterministic_policies() if p != "auto"]
EVERY_TOKEN = ("reference", "batch-invariant")  # release each token as it is made (margin and dvr: once verified)


def ask(policy: str) -> dict:
    return dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=96,
                extra_body={"determinism": {"policy": policy}})


@pytest.mark.parametrize("policy", POLICIES)
def test_streamed_tool_calls_are_the_whole_calls_bitwise_beside_streaming_clients(client, server, policy):
    whole = client.chat.completions.create(**ask(policy)).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    with StreamingLoad(server, 3, max_tokens=16):
        chunks = list(client.chat.completions.create(**ask(policy), stream=True))
        with client.chat.completions.stream(**ask(policy)) as s:  # the SDK's own accumulation
            events = list(s)
            final = s.get_final_completion().choices[0]
    deltas = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or []]
    names = {d.index: (d.id, d.function.name) for d in deltas if d.function.name}
    assert all(d.id is None for d in deltas if not d.function.name)  # the id and name once, in the first delta
    joined = [(names[i][1], "".join(d.function.arguments or "" for d in deltas if d.index == i)) for i in sorted(names)]
    assert joined == expected
    assert all(i.startswith("call_") for i, _ in names.values()) and len({i for i, _ in names.values()}) == len(names)
    if policy in EVERY_TOKEN:  # fragments as the tokens come, not one piece at the end
        assert len([d for d in deltas if d.index == 0 and d.function.arguments]) > 1
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == expected
    assert final.finish_reason == "tool_calls"
    fragments = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta" and e.index == 0]
    assert "".join(fragments) == expected[0][1] and (len(fragments) > 1 or policy not in EVERY_TOKEN)


def test_text_before_a_call_streams_as_content(client):
    """`auto` on a template without a tool format: the grammar allows text or calls; whichever the model
    writes, the stream's content and calls are the whole answer's."""
    body = dict(model=MODEL, messages=chat("Say hello, then check the weather in Rome."), tools=[WEATHER],
                max_tokens=64, extra_body={"determinism": {"policy": "batch-invariant"}})
    whole = client.chat.completions.create(**body).choices[0]
    chunks = list(client.chat.completions.create(**body, stream=True))
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert content == (whole.message.content or "")
    deltas = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in deltas) == "".join(
        c.function.arguments for c in whole.message.tool_calls or [])


@pytest.mark.parametrize("policy", POLICIES)
def test_responses_stream_function_call_arguments_as_they_come(client, policy):
    tool = {"type": "function", **WEATHER["function"]}
    kw = dict(model=MODEL, input=ASK[0]["content"], tools=[tool], tool_choice="required", max_output_tokens=96,
              extra_body={"determinism": {"policy": policy}})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    calls = [i for i in whole.output if i.type == "function_call"]
    assert calls and [i.type for i in final.output] == [i.type for i in whole.output]
    for index, item in enumerate(final.output):
        fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.output_index == index]
        added = [e.item for e in events if e.type == "response.output_item.added" and e.output_index == index]
        assert added[0].name == item.name and added[0].id == item.id and added[0].call_id == item.call_id
        assert "".join(fragments) == item.arguments == calls[index].arguments
        assert len(fragments) > 1 or policy not in EVERY_TOKEN
    assert json.loads(final.output[0].arguments)["city"]
