"""Structured output on the embedded model: the grammar's mask holds the output to a JSON schema,
any JSON object, a regex, a choice or a grammar, under a deterministic policy bitwise the same alone,
in a batch, under load and streamed; logprobs raw or processed (the masked distribution); a bad
constraint is a 400 naming its field and never reaches the engine thread."""
from __future__ import annotations

import json
import math

import pytest
import torch

from margingate.data.prompts import Prompt
from margingate.engine import Request
from margingate.options import SamplingParams
from margingate.options.structured import StructuredError, StructuredOutput

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, chat  # noqa: E402
from test_server_logprobs import Load  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = "Give me a person as JSON with a name and an age."
BI = {"determinism": {"policy": "batch-invariant"}}


def ids(llm, text):
    return llm.tokenizer.encode_prompt(Prompt("chat", tuple(chat(text)), None, "t"))


def generate(llm, prompts, samplings, policy="batch-invariant", tokens=48):
    reqs = [Request(p, tokens, llm.policy(policy), request_id=f"g{i}", sampling=sp)
            for i, (p, sp) in enumerate(zip(prompts, samplings))]
    return llm.engine.generate(reqs)


@pytest.mark.parametrize("constraint, check", [
    pytest.param(StructuredOutput(json=PERSON), lambda t: set(json.loads(t)) == {"name", "age"},
                 marks=pytest.mark.slow),  # the longest; the server's test below parses a json_schema too
    (StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: len(t) == 8 and t[3] == "-"),
    (StructuredOutput(choice=("red", "green", "blue")), lambda t: t in ("red", "green", "blue")),
    (StructuredOutput(grammar='start: "x" ("y" | "z") ("y" | "z")? "!"'), lambda t: t[0] == "x" and t[-1] == "!"),
], ids=["json_schema", "json_object", "regex", "choice", "grammar"])
def test_the_output_matches_its_constraint_alone_and_in_a_batch(llm, constraint, check):
    prompt = ids(llm, ASK)
    sp = SamplingParams(structured=constraint, logprobs=2)
    batch = generate(llm, [ids(llm, "Tell me about rivers."), prompt, prompt],
                     [SamplingParams(), sp, SamplingParams(temperature=0.7, seed=3, structured=constraint)])
    alone = generate(llm, [prompt], [sp])[0]
    assert batch[1].token_ids == alone.token_ids and batch[1].logprobs == alone.logprobs
    for r in (alone, batch[2]):
        assert r.finish_reason == "stop" and check(llm.tokenizer.decode(r.token_ids)), llm.tokenizer.decode(r.token_ids)


def test_logprobs_raw_or_processed(llm):
    """processed: the masked distribution (the allowed tokens' probabilities sum to 1, top alternatives are
    allowed ones); raw: the model's, the unconstrained request's at the same position."""
    prompt, choice = ids(llm, "Is the sea wet? Answer yes or no."), StructuredOutput(choice=("yes", "no"))
    processed, raw = generate(llm, [prompt, prompt], [SamplingParams(structured=choice, logprobs=5),
                                                      SamplingParams(structured=choice, logprobs=5,
                                                                     logprobs_mode="raw")])
    free = generate(llm, [prompt], [SamplingParams(logprobs=5)])[0]
    first = llm.tokenizer.decode(processed.token_ids[:1])
    assert processed.token_ids == raw.token_ids and first in ("yes", "no", "y", "n")
    allowed = [t for t, _ in processed.logprobs[0].top]
    assert {llm.tokenizer.decode([t]) for t in allowed} <= {"yes", "no", "y", "n", "ye"}
    assert math.isclose(sum(math.exp(lp) for _, lp in processed.logprobs[0].top), 1.0,
                        rel_tol=1e-5)
    assert raw.logprobs[0].top == free.logprobs[0].top  # the model's own distribution, mask or not
    assert processed.logprobs[0].logprob > raw.logprobs[0].logprob


@pytest.mark.parametrize("bad, option", [({"json": 3}, "json"), ({"regex": ""}, "regex"),
                                         ({"choice": []}, "choice"), ({"regex": "a", "grammar": "b"}, "grammar"),
                                         ({}, "json")])
def test_a_bad_constraint_names_its_field(bad, option):
    with pytest.raises(StructuredError) as exc:
        StructuredOutput(**bad)
    assert exc.value.option == option


# --- through the server, with the openai client ---------------------------------------------------

def person(client, **kw):
    r = client.chat.completions.create(model=MODEL, messages=chat(ASK), max_tokens=48, logprobs=True,
                                       top_logprobs=2, response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": PERSON, "strict": True}},
                                       extra_body=BI, **kw)
    c = r.choices[0]
    return c.message.content, c.model_extra["token_ids"], [(t.token, t.logprob) for t in c.logprobs.content]


def test_json_schema_parsed_by_the_client_bitwise_alone_loaded_and_streamed(client, server):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    parsed = client.chat.completions.parse(model=MODEL, messages=chat(ASK), max_tokens=48, response_format=Person,
                                           extra_body=BI)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    alone = person(client)
    assert set(json.loads(alone[0])) == {"name", "age"}
    with Load(server, 8):
        assert person(client) == alone
        text, toks, lps = "", [], []
        for ev in client.chat.completions.create(model=MODEL, messages=chat(ASK), max_tokens=48, logprobs=True,
                                                 top_logprobs=2, stream=True, extra_body=BI,
                                                 response_format={"type": "json_schema", "json_schema": {
                                                     "name": "person", "schema": PERSON}}):
            for c in ev.choices:
                text += c.delta.content or ""
                toks += c.model_extra.get("token_ids") or []
                lps += [(t.token, t.logprob) for t in (c.logprobs.content if c.logprobs else [])]
        assert (text, toks, lps) == alone


@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),  # may be cut by max_tokens
    ({"guided_regex": "[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_grammar": 'start: "ok" | "no"'}, lambda t: t in ("ok", "no")),
    ({"guided_json": PERSON}, lambda t: set(json.loads(t)) == {"name", "age"}),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
], ids=["json_object", "guided_regex", "guided_choice", "guided_grammar", "guided_json", "structured_outputs"])
def test_completions_take_every_constraint_field(client, extra, check):
    r = client.completions.create(model=MODEL, prompt="Here is the answer:", max_tokens=40, extra_body=extra)
    assert check(r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"logprobs_mode": "cooked"}, "logprobs_mode"),
])
def test_bad_constraints_are_a_400_naming_the_field_and_the_server_goes_on(http, body, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_grammar_error_clears_when_the_refused_token_is_rolled_back(llm):
    """A token the grammar refuses leaves only the stop tokens allowed; once a repair or a rollback takes
    that token back, the grammar follows the corrected tokens and allows what it allowed before (the
    error never outlives its token: issue 47)."""
    matcher = llm.grammars.matcher(StructuredOutput(json=PERSON))
    stop = frozenset(llm.config.eos_token_ids)
    start = matcher.allowed([], stop).clone()
    opening = int(start.nonzero()[0])  # a token the schema allows first
    after = matcher.allowed([opening], stop).clone()
    refused = int((~after).nonzero()[-1])
    assert after.sum() > len(stop)
    only_stop = matcher.allowed([opening, refused], stop)
    assert matcher.error is not None and int(only_stop.sum()) <= len(stop)
    assert matcher.allowed([opening, refused, opening], stop).sum() == only_stop.sum()  # still in error
    assert torch.equal(matcher.allowed([opening], stop), after) and matcher.error is None  # taken back
    assert torch.equal(matcher.allowed([], stop), start)
    matcher.allowed([opening, int(after.nonzero()[0])], stop)  # an allowed token goes on without an error
    assert matcher.error is None
