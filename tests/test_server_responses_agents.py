"""openai-agents against `/v1/responses`, as its default model runs: `Agent(model=<name>)` with the default
client pointed at the server, the default API (Responses), tracing off. A forced function call, run and
returned; an agent at auto held to its output type (a json_schema text format), whole and streamed. Skips where
openai-agents is not installed. (An answer cut by max_tokens is `incomplete`, which openai-agents raises on, as
it does against OpenAI: the answers here end.)"""
from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, agents_against, weather_agent  # noqa: E402

BI = {"determinism": {"policy": "batch-invariant"}}


class Colour(BaseModel):
    colour: Literal["red", "green", "blue"]


@pytest.fixture
def agents(server):
    yield from agents_against(server.url)


def test_an_agent_with_a_function_tool_runs_over_responses(agents):
    asked, agent = weather_agent(agents, MODEL, tool_use_behavior="stop_on_first_tool")
    forced = agents.Runner.run_sync(agent(tool_choice="required"), "What is the weather in Paris?", max_turns=2)
    assert asked == ["Paris"] and forced.final_output == "sunny, 21 degrees"
    assert [r.response_id[:5] for r in forced.raw_responses] == ["resp_"]  # served by /v1/responses
    typed = agents.Agent(name="colour", instructions="Answer with a colour.", tools=agent().tools, model=MODEL,
                         output_type=Colour, model_settings=agents.ModelSettings(max_tokens=48, extra_body=BI))
    free = agents.Runner.run_sync(typed, "What colour is the sky?", max_turns=2)
    assert isinstance(free.final_output, Colour) and not asked[1:]


def test_an_agent_loop_sends_each_call_and_its_output_back(agents):
    """The default tool_use_behavior: each call's output goes back as openai-agents writes the items
    (function_call, function_call_output) and the model is asked again. The embedded model, asked again under
    auto, calls the tool again, turn after turn, so the run ends at max_turns; every turn's request was served."""
    asked, weather = weather_agent(agents, MODEL, answer="sunny")
    agent = weather(tool_choice="required")
    with pytest.raises(agents.MaxTurnsExceeded):
        agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(asked) == 3 and asked[0] == "Paris"


def test_an_agent_streams_over_responses(agents):
    import asyncio

    async def run():
        agent = agents.Agent(name="colour", instructions="Answer with a colour.", model=MODEL, output_type=Colour,
                             model_settings=agents.ModelSettings(max_tokens=48, extra_body=BI))
        result = agents.Runner.run_streamed(agent, "What colour is the sky?")
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"]
        return "".join(deltas), result.final_output
    streamed, final = asyncio.run(run())
    assert Colour.model_validate_json(streamed) == final
