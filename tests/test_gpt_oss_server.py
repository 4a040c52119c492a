"""A harmony tool call through the openai SDK: a tiny random gpt-oss (transformers' own classes) with the
embedded model's vocabulary, harmony's marks added as special tokens and gpt-oss's chat template, served by our
server. A forced call (a named function) is held to harmony's form by the grammar and comes back as the SDK's
`tool_calls`, its arguments the function's JSON; alone and under a batch-invariant policy, twice the same; and
the call sent back renders through the template into the model's own harmony."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # a model built, a server started, three requests
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
tf = pytest.importorskip("transformers")

from gpt_oss_model import tiny_harmony_model  # noqa: E402
from server_fixtures import make_server  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}
BI = {"determinism": {"policy": "batch-invariant"}}


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory):
    from margingate import LLM

    llm = LLM(str(tiny_harmony_model(tmp_path_factory.mktemp("gpt-oss"))), max_model_len=2048)
    srv = make_server(llm, slots=4, max_len=2048)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=180)
        client.served = srv.state.model_id
        yield client
    finally:
        srv.stop()


def test_a_harmony_tool_call_through_the_openai_sdk(harmony_client):
    def ask():
        r = harmony_client.chat.completions.create(
            model=harmony_client.served, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40,
            extra_body=BI)
        return r.choices[0]

    first = ask()
    assert first.finish_reason == "tool_calls", first
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    again = ask()
    assert again.message.tool_calls[0].function.arguments == call.function.arguments
    answered = harmony_client.chat.completions.create(
        model=harmony_client.served, max_tokens=4, extra_body=BI, tools=[WEATHER],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")
