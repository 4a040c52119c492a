"""Tool calls on a real model under its own chat template: Qwen2.5-Coder-0.5B-Instruct (the `qwen2.5-coder-0.5b`
GGUF, a template with a tool format: `<tool_call>` blocks) behind `margingate serve`, as clients run it.
LangChain's `bind_tools` (tool_choice auto) and an openai-agents agent (its default API, Responses) each run a
tool loop to its end: the call, the tool's result sent back, an answer; LangChain's `with_structured_output`
both ways (a json_schema, a forced call); the shapes the model writes its calls in outside its template's
blocks (a bare JSON object, one in a ```json fence) are calls, streamed as calls, bitwise the whole answer.

Greedy (temperature 0) under batch-invariant, so each answer is reproducible; the prompts are ones on which
this 0.5B model calls the tool (it often writes its call as bare or fenced JSON, not in its template's block).
Asked again after the tool's result, it repeats its call's JSON and then the result's (`{"name": ...}` then
`{"forecast": "rain"}`): two objects, so no call, and the loop ends on that text. Slow tier (the model loads
in seconds, each loop takes a few); skipped with the install command where the model is absent, and per
client where LangChain or openai-agents is not installed."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import TIMEOUT, agents_against, make_server  # noqa: E402

NAME = "qwen2.5-coder-0.5b"
BI = {"determinism": {"policy": "batch-invariant"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
UMBRELLA = "Should I take an umbrella in London today?"
FORECAST = '{"city": "London", "forecast": "rain"}'


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def served():
    from margingate import LLM
    from margingate.models.named import ModelNotFoundError

    try:
        llm = LLM(NAME, max_num_seqs=4)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (or `make models`)")
    srv = make_server(llm, slots=4, max_len=2048, default_max_tokens=128)
    yield srv, llm
    srv.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0].url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def langchain_chat(served):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed "
                                                                      "(pip install langchain-openai)")
    return langchain_openai.ChatOpenAI(model=NAME, base_url=f"{served[0].url}/v1", api_key="unused", temperature=0,
                                       max_tokens=96, max_retries=0, timeout=TIMEOUT, extra_body=BI)


def test_langchain_bind_tools_runs_a_tool_loop(served):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    asked = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return FORECAST

    model = langchain_chat(served).bind_tools([get_weather], tool_choice="auto")
    messages = [HumanMessage(UMBRELLA)]
    call = model.invoke(messages)
    messages += [call, *(ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in call.tool_calls)]
    answer = model.invoke(messages)
    print("langchain:", call.tool_calls, "->", repr(answer.content))
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", {"city": "London"})]
    assert asked == ["London"] and call.response_metadata["finish_reason"] == "tool_calls"
    assert not answer.tool_calls and "rain" in answer.content  # an answer, from the tool's result


def test_langchain_with_structured_output(served):
    """Its default (a json_schema response format) and a forced call of the schema as a tool, which the grammar
    holds to Qwen's `<tool_call>` token (before, llguidance refused the token its mask offered)."""
    chat, ask = langchain_chat(served), "Which city is the capital of France?"
    by_schema = chat.with_structured_output(City).invoke(ask)
    by_call = chat.with_structured_output(City, method="function_calling").invoke(ask)
    print("with_structured_output:", repr(by_schema), repr(by_call))
    assert by_schema == City(name="Paris", country="France")
    assert isinstance(by_call, City) and by_call.country == "France"


@pytest.fixture
def agents(served):
    yield from agents_against(served[0].url)


def test_an_openai_agents_agent_runs_a_tool_loop_over_responses(agents):
    """Its default model settings but for our determinism block: Responses, tool_choice auto."""
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return FORECAST

    agent = agents.Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather], model=NAME,
                         model_settings=agents.ModelSettings(extra_body=BI))
    result = agents.Runner.run_sync(agent, UMBRELLA, max_turns=3)
    calls = [i.raw_item for i in result.new_items if i.type == "tool_call_item"]
    print("openai-agents:", [(c.name, c.arguments) for c in calls], "->", repr(result.final_output))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "London"})]
    assert asked == ["London"] and [r.response_id[:5] for r in result.raw_responses] == ["resp_", "resp_"]
    assert "rain" in result.final_output


def whole_and_streamed(client, extra: dict | None = None, **body) -> tuple[tuple, tuple, list[int]]:
    """(content, calls) of the whole answer and of its stream, and the whole answer's token ids; `extra`: our
    fields beside the determinism block."""
    body.update(model=NAME, temperature=0, extra_body={**BI, **(extra or {})})
    whole = client.chat.completions.create(**body).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    content, names, arguments = "", {}, {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                names[d.index] = d.function.name or names.get(d.index)
                arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
    streamed = (content or None, [(names[i], arguments[i]) for i in sorted(names)])
    return (whole.message.content, calls), streamed, whole.model_extra["token_ids"]


@pytest.mark.parametrize("ask, shape", [("What is the weather in Paris?", "{"),
                                        ("Use the get_weather tool to find the weather in Paris.", "```json\n")])
def test_the_models_own_call_shapes_are_calls_streamed_as_the_whole(served, client, ask, shape):
    """The model writes its call as a bare JSON object, or as one in a ```json fence, not in its template's
    `<tool_call>` block; either is a call, and the stream's call is the whole one, bitwise."""
    whole, streamed, ids = whole_and_streamed(client, messages=[{"role": "user", "content": ask}], tools=[WEATHER],
                                              max_tokens=96)
    written = served[1].tokenizer.decode(ids)
    print("written:", repr(written), "->", whole)
    assert written.startswith(shape) and "<tool_call>" not in written
    assert whole[0] is None and [(n, json.loads(a)) for n, a in whole[1]] == [("get_weather", {"city": "Paris"})]
    assert streamed == whole


def test_text_then_a_fenced_call_keeps_the_text(served, client):
    """The text-then-call case under auto. This model does not write it unasked, so a regex holds the answer to
    its shape (a sentence, then the call in a ```json fence) and the model writes the words: the sentence is the
    content, the fence a call, and the stream is the whole answer, bitwise, across the real tokenizer's pieces
    (a token may end the sentence and open the fence)."""
    shape = (r'[A-Z][a-z ,]{2,60}\.\n```json\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,20}"\}\}'
             r'\n```')
    whole, streamed, ids = whole_and_streamed(client, messages=[{"role": "user", "content": "Is it sunny in Rome?"}],
                                              tools=[WEATHER], max_tokens=96, extra={"guided_regex": shape})
    written = served[1].tokenizer.decode(ids)
    print("written:", repr(written), "->", whole)
    content, calls = whole
    assert content and "```" not in content and written.startswith(content)
    assert [n for n, _ in calls] == ["get_weather"] and set(json.loads(calls[0][1])) == {"city"}
    assert streamed == whole
