"""A grammar and a forced tool call under the verifying policies and speculation, through the server with
the openai client (issue 47): a `response_format` json_schema, and tools with `tool_choice` naming a
function, each beside streaming clients under margin with a flip injected where the grammar forces the
token (the wrong token puts the grammar in error; the strict replay rolls it back), under dvr, under
verify-all (every step verified, forced ones too) and with ngram speculation asked for (off for a
constrained request, as the report says): text, tool calls, token ids and logprobs bitwise the same
request alone under reference."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, StreamingLoad, chat  # noqa: E402
from test_structured_output import ASK as PERSON_ASK  # noqa: E402
from test_structured_output import PERSON  # noqa: E402
from test_tools import ASK as WEATHER_ASK  # noqa: E402
from test_tools import TIME, WEATHER  # noqa: E402

REQUESTS = {
    "json_schema": {"messages": chat(PERSON_ASK), "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
    "named_tool": {"messages": WEATHER_ASK, "tools": [WEATHER, TIME],
                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}
FINISH = {"json_schema": "stop", "named_tool": "tool_calls"}


def answer(client, body: dict, policy: str, **extra) -> tuple[tuple, dict]:
    """`body` under `policy`: (content, tool calls, finish reason, token ids, logprobs with the top 2) and
    the determinism report (`person` and `call` in the modules above return neither the top nor the report)."""
    r = client.chat.completions.create(model=MODEL, max_tokens=48, logprobs=True, top_logprobs=2,
                                       extra_body={"determinism": {"policy": policy}, **extra}, **body)
    c = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    lps = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in c.logprobs.content]
    return (c.message.content, calls, c.finish_reason, c.model_extra["token_ids"], lps), r.model_extra["determinism"]


@pytest.fixture
def flip_margin_at(server, monkeypatch):
    """`inject_flip_at` is a testing option that HTTP does not take: this hands it to the margin policies
    the server builds for its requests (`state.context.policy`), until the test ends."""
    context = server.state.context
    build = context.policy

    def at(k: int) -> None:
        monkeypatch.setattr(context, "policy", lambda spec, **kw: build(
            spec.replace(inject_flip_at=k) if getattr(spec, "name", None) == "margin" else spec, **kw))
    return at


@pytest.mark.parametrize("kind", REQUESTS)
def test_a_constrained_request_equals_reference_alone_under_verifying_policies(client, server, flip_margin_at,
                                                                                kind):
    body = REQUESTS[kind]
    want, _ = answer(client, body, "reference")
    ids, lps = want[3], want[4]
    assert want[2] == FINISH[kind] and len(ids) == len(lps) and (want[0] or want[1]), want
    # a forced position: the grammar allows one token, so the masked distribution lists one alternative
    forced = [i for i, (_, _, top) in enumerate(lps) if i >= 1 and len(top) == 1]
    assert forced, lps
    flip_margin_at(forced[0])
    with StreamingLoad(server, 3, max_tokens=16):
        got, report = answer(client, body, "margin")
        assert got == want and report["injected"] == 1 and report["rollbacks"] >= 1, report
        got, report = answer(client, body, "dvr")
        assert got == want and report["replayed_tokens"] >= len(ids) - 1, report
        got, report = answer(client, body, "verify-all")
        assert got == want, report
        assert report["triggers"] == report["steps"] == len(ids) - 1, report  # the first token is the prefill's
        got, report = answer(client, body, "batch-invariant", speculative={"method": "ngram"})
        assert got == want and report["speculation"] == "off", report


def test_verify_all_verifies_the_steps_a_grammar_forces(llm):
    """A forced step's one finite score has an infinite margin, which verify-all's gate (margin < tau = inf)
    let through on the fast path: its K/V column stayed the fast one and the later verified rows read it,
    so logprobs differed from batch-invariant while both claimed them guaranteed (issue 47). Every step is
    verified now, the forced ones too."""
    from margingate.data.prompts import Prompt
    from margingate.engine import Request
    from margingate.options import SamplingParams
    from margingate.options.structured import StructuredOutput

    prompt = llm.tokenizer.encode_prompt(Prompt("chat", tuple(chat(PERSON_ASK)), None, "t"))
    sp = SamplingParams(structured=StructuredOutput(json=PERSON), logprobs=2)
    r = llm.engine.generate([Request(prompt, 24, llm.policy("verify-all"), sampling=sp)])[0]
    forced = sum(len(lp.top) == 1 for lp in r.logprobs[1:])
    assert forced and r.stats["triggers"] == r.stats["steps"] == len(r.token_ids) - 1, (forced, r.stats)
