"""Stop strings cut token ids, logprobs and usage at the token that completes the stop string: the
same ids, logprobs and usage under every deterministic policy, alone and under load (margin deferring
while other requests force verifier passes), and with speculation (a step that accepted tokens past
the stop string)."""
from __future__ import annotations

import dataclasses

import pytest

from margingate.data.prompts import Prompt
from margingate.engine import Request
from margingate.engine.stops import StopStrings
from margingate.options import SamplingError, SamplingParams, SpeculativeConfig, deterministic_policies

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, StreamingLoad, chat  # noqa: E402

ANIMALS = "Name ten animals, separated by commas:"
POLICIES = [p for p in deterministic_policies() if p != "auto"]  # auto resolves to one of these


def test_the_completing_token_is_the_shortest_prefix_holding_the_stop(llm):
    ids = llm.tokenizer.encode("one, two, three, four")
    stops = StopStrings([", thr"], llm.tokenizer.decode)
    keep = stops.completing(ids)
    assert ", thr" in llm.tokenizer.decode(ids[:keep]) and ", thr" not in llm.tokenizer.decode(ids[:keep - 1])
    assert stops.completing(ids[:keep - 1]) is None and StopStrings(["five"], llm.tokenizer.decode).completing(ids) \
        is None


@pytest.mark.parametrize("stop", ["", ["a", ""], [3], 7])
def test_a_bad_stop_names_the_field(stop):
    with pytest.raises(SamplingError) as exc:
        SamplingParams(stop=stop)
    assert exc.value.option == "stop"


def engine_run(llm, prompt_ids, policy, stop, speculative=None):
    req = Request(prompt_ids, 64, llm.policy(policy), sampling=SamplingParams(logprobs=1, stop=(stop,)),
                  speculative=speculative)
    r = llm.engine.generate([req])[0]
    return r.token_ids, [(t.token, t.logprob) for t in r.logprobs], r.finish_reason


def test_speculation_past_the_stop_string_is_cut(llm, monkeypatch):
    """A speculative step accepts several tokens; the stop string completes inside them: the output ends
    at the completing token, as plain decoding's does (and the cut really happened inside a step)."""
    monkeypatch.setattr(llm.engine, "config", dataclasses.replace(llm.engine.config, speculative_cost_model=False))
    ids = llm.tokenizer.encode_prompt(Prompt("chat", tuple(chat(
        "Copy this sentence twice: The quick brown fox jumps over the lazy dog.")), None, "t"))
    full = llm.engine.generate([Request(ids, 40, llm.policy("batch-invariant"))])[0].token_ids
    text = llm.tokenizer.decode(full)
    stop = "jumps"
    assert stop in text, text
    cuts = []
    completing = StopStrings.completing
    monkeypatch.setattr(StopStrings, "completing", lambda self, out: cuts.append((len(out), completing(self, out)))
                        or cuts[-1][1])
    spec = engine_run(llm, ids, "batch-invariant", stop, SpeculativeConfig("ngram", num_tokens=8))
    assert any(keep is not None and keep < n for n, keep in cuts), cuts  # accepted past the stop, then cut
    plain = engine_run(llm, ids, "batch-invariant", stop)
    assert spec == plain and plain[2] == "stop"
    assert stop in llm.tokenizer.decode(plain[0]) and stop not in llm.tokenizer.decode(plain[0][:-1])


# --- through the server, with the openai client ---------------------------------------------------

def completion(client, policy, **extra):
    r = client.completions.create(model=MODEL, prompt=ANIMALS, max_tokens=64, temperature=0, logprobs=1,
                                  stop=["Kafeki"], extra_body={"determinism": {"policy": policy}, **extra})
    c = r.choices[0]
    return c.text, c.model_extra["token_ids"], c.logprobs.token_logprobs, r.usage.completion_tokens, c.finish_reason


def streamed(client, policy):
    text, ids, lps, usage, reason = "", [], [], None, None
    for ev in client.completions.create(model=MODEL, prompt=ANIMALS, max_tokens=64, temperature=0, logprobs=1,
                                        stop=["Kafeki"], stream=True, stream_options={"include_usage": True},
                                        extra_body={"determinism": {"policy": policy}}):
        if ev.usage is not None:
            usage = ev.usage.completion_tokens
        for c in ev.choices:
            text += c.text
            ids += c.model_extra["token_ids"]
            lps += c.logprobs.token_logprobs if c.logprobs else []
            reason = c.finish_reason or reason
    return text, ids, lps, usage, reason


def Forcing(server, clients: int) -> StreamingLoad:  # noqa: N802 (used as a context manager, like a class)
    """`clients` threads streaming requests that verify every step (verify-all): a verifier pass runs on
    every step, and a deferring margin request rides along on each, so its release bursts move."""
    return StreamingLoad(server, clients, max_tokens=16, extra_body={"determinism": {"policy": "verify-all"}})


def test_the_issue_case_is_the_same_under_every_policy_alone_loaded_and_speculating(client, server, llm):
    """The issue's request: one (text, ids, logprobs, usage) under every deterministic policy; under 8
    streaming clients forcing verifier passes (margin deferring rides along); streamed; speculating."""
    want = completion(client, "reference")
    text, ids, lps, usage, reason = want
    assert reason == "stop" and len(ids) == len(lps) == usage
    full = llm.tokenizer.decode(ids)
    assert "Kafeki" in full and "Kafeki" not in llm.tokenizer.decode(ids[:-1]) and text == full[:full.index("Kafeki")]
    for policy in POLICIES:
        assert completion(client, policy) == want, policy
    assert completion(client, "batch-invariant", speculative={"method": "ngram"}) == want
    with Forcing(server, 8):
        for policy in POLICIES:
            assert completion(client, policy) == want, f"{policy} under load"
        assert streamed(client, "margin") == want
        assert completion(client, "batch-invariant", speculative={"method": "ngram"}) == want
