"""Agent frameworks against the server, as users run them: openai-agents with a function tool (its first turn
forces a call, then it resets tool_choice to the default, auto), and the requests LangChain's `bind_tools`
sends (no tool_choice), by hand with the openai client. On the embedded model, whose chat template has no
tool format: before issue 47 the turn after the call was a 400."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, chat, weather_agent  # noqa: E402

BI = {"determinism": {"policy": "batch-invariant"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}


def test_openai_agents_function_tools_run(server):
    """A forced call, run and returned (stop_on_first_tool: the embedded model, asked again under auto, calls
    the same tool again, turn after turn); and an agent left at auto answering a question in text."""
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install openai-agents)")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    asked, agent = weather_agent(agents, agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                                 tool_use_behavior="stop_on_first_tool")
    forced = agents.Runner.run_sync(agent(tool_choice="required"), "What is the weather in Paris?", max_turns=2)
    assert asked == ["Paris"] and forced.final_output == "sunny, 21 degrees"
    free = agents.Runner.run_sync(agent(), "What is 2 + 2?", max_turns=2)
    assert isinstance(free.final_output, str) and free.final_output


def langchain_turns(client) -> list:
    """bind_tools' requests: tools and no tool_choice, the call's result sent back, the same tools again."""
    messages = chat("What is the weather in Paris? Call get_weather.")
    out = []
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=48,
                                           extra_body=BI)
        m = r.choices[0].message
        out.append((r.choices[0].finish_reason, m.content, [(c.function.name, c.function.arguments)
                                                           for c in m.tool_calls or []]))
        if not m.tool_calls:
            return out
        messages += [m.model_dump(exclude_none=True),
                     *({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"sky": "sunny"})}
                       for c in m.tool_calls)]
    return out


def test_langchains_bind_tools_requests_answer_the_same_twice(client):
    turns = langchain_turns(client)
    assert turns and all(reason in ("stop", "length", "tool_calls") for reason, _, _ in turns)
    assert all(json.loads(arguments) for _, _, calls in turns for _, arguments in calls)
    assert langchain_turns(client) == turns
