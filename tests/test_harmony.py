"""gpt-oss's harmony format (server/harmony.py): the analysis channel as reasoning, calls to offered functions as
tool calls, the final channel as content; streamed in any cut of the text, the pieces join to the whole answer's.
The end-to-end call through the openai SDK, on a tiny gpt-oss with a harmony template, is in
tests/test_gpt_oss_server.py."""
from __future__ import annotations

import pytest

from margingate.models.chat_template import is_harmony
from margingate.server.parsers.answer import Answer
from margingate.server.parsers.harmony import HarmonyParser, grammar

ANSWER = ("<|channel|>analysis<|message|>The user wants the weather. Call it.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"city": "Paris"}<|call|>')
FINAL = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"


def read(text: str, cuts: int = 1, names=("get_weather",), limit: int = 1) -> Answer:
    """The answer of `text` fed in pieces of `cuts` characters."""
    answer, parser = Answer(stripped=True), HarmonyParser(set(names), limit)
    for i in range(0, len(text), cuts):
        answer.take(parser.feed(text[i:i + cuts]))
    answer.take(parser.finish())
    return answer


@pytest.mark.parametrize("cuts", [1, 3, 7, 10_000])
def test_analysis_is_reasoning_and_a_call_to_an_offered_function_is_a_call(cuts):
    a = read(ANSWER, cuts)
    assert a.reasoning == "The user wants the weather. Call it."
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in a.calls]
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert a.content == ""


@pytest.mark.parametrize("cuts", [1, 5, 10_000])
def test_the_final_channel_is_the_content(cuts):
    a = read(FINAL, cuts)
    assert (a.reasoning, a.content, a.calls) == ("Easy.", "It is sunny.", [])


def test_a_recipient_before_the_channel_and_a_function_not_offered():
    """`to=` may precede the channel (the template writes calls sent back so); a function not offered, or past
    the calls allowed, is content, never a call."""
    before = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    assert read(before).calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    other = read(before.replace("get_weather", "delete_all"))
    assert not other.calls and other.content == '{"city": "Oslo"}'
    twice = read(before + "<|start|>assistant" + before, limit=1)
    assert len(twice.calls) == 1 and twice.content == '{"city": "Oslo"}'


def test_text_without_harmony_is_content_and_a_cut_body_goes_as_far_as_it_went():
    assert read("just text, no channels").content == "just text, no channels"
    cut = read("<|channel|>final<|message|>It is sun")
    assert cut.content == "It is sun"


def test_the_template_and_the_grammar():
    from margingate.server.protocol.bodies import ChatCompletionRequest

    assert is_harmony("<|start|>{{ x }}<|channel|>final<|message|>") and not is_harmony("<|im_start|>")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool])
    lark = grammar(body.tools, frozenset({"<|channel|>", "<|message|>"}))
    assert 'call0: <|channel|> "commentary to=functions.get_weather " "<|constrain|>" "json" <|message|> body0' in lark
    assert '"additionalProperties": false' in lark
