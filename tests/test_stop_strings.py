"""Stop strings and the text of a request, from one incremental detokenizer (`engine/detokenize.py`) that
the engine, the server, `LLM` and the CLI share. A stop string cuts token ids, logprobs and usage at the
token that completes it and the text before it: the same text and logprobs under every deterministic
policy, alone and batched, with speculation (a step that accepted tokens past the stop string), after a
repair's rollback, streamed or whole; UTF-8 stops (accented, emoji); n > 1; chat streaming; the CLI."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from margingate.cli import main
from margingate.data.prompts import Prompt
from margingate.engine import Request
from margingate.engine.detokenize import Detokenizer, text_decoder
from margingate.options import SamplingError, SamplingParams, SpeculativeConfig, deterministic_policies

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from server_fixtures import MODEL, StreamingLoad, chat  # noqa: E402

ANIMALS = "Name ten animals, separated by commas:"
FRENCH = "Écris une phrase en français sur le café."  # greedy: "Ce phrase est une phrase en français sur le café."
POLICIES = [p for p in deterministic_policies() if p != "auto"]  # auto resolves to one of these


@pytest.fixture(scope="module")
def decode(llm):
    return text_decoder(llm.tokenizer)


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_prompt(Prompt("chat", tuple(chat(text)), None, "t"))


# --- the detokenizer alone ---------------------------------------------------------------------------

@pytest.mark.parametrize("stops", [[], ["STOP"], ["世界"], ["🎉"], ["wörld"], ["é"], [", 3"], ["zz", "more"]])
def test_text_fed_in_any_chunks_is_the_whole_decode_cut_at_the_first_stop(llm, decode, stops):
    """Tokens fed in chunks of 1 to 3 (a speculative step's), the released deltas held back where a stop
    string may start: their sum is decode(ids) cut at the first stop string, and so is `final_text`."""
    rng = random.Random(0)
    for text in ["Hello wörld — ünïcödé 你好世界 🎉🎉 done.\n\nNew", "Count: 1, 2, 3, 4", "a b STOP and more"]:
        ids = llm.tokenizer.encode(text)
        full = decode(ids)
        cuts = [full.find(s) for s in stops if s in full]
        expected = full[:min(cuts)] if cuts else full
        for _ in range(4):
            d, out, n = Detokenizer(decode, stops), "", 0
            while n < len(ids) and d.stop_at is None:
                n = min(len(ids), n + rng.randint(1, 3))
                stop_at = d.feed(ids[:n])
                out += d.release(n if stop_at is None else stop_at, finished=False)
            out += d.release(len(d), finished=True)
            assert out == d.final_text() == expected and (d.stop_at is not None) == bool(cuts)
            if cuts:  # the completing token: its prefix holds the stop string, the one before does not
                assert any(s in decode(ids[:d.stop_at]) for s in stops)
                assert not any(s in decode(ids[:d.stop_at - 1]) for s in stops)


def test_a_rollback_restores_the_state_a_fresh_feed_reaches(llm, decode):
    """A repair drops tokens (here inside an emoji's bytes) and appends others: the text, each token's
    state and the stop are what feeding the new tokens from the start gives; a stop that was completed by
    a dropped token is gone."""
    ids = llm.tokenizer.encode("Hello wörld 🎉 and more")
    other = llm.tokenizer.encode(" and less, then more")
    k = next(i for i in range(1, len(ids)) if decode(ids[:i]).endswith("\ufffd"))  # a cut inside the emoji
    d = Detokenizer(decode, ["more"])
    assert d.feed(ids) == len(ids)
    d.rollback(k)
    assert d.stop_at is None and d.text == decode(ids[:k]).rstrip("\ufffd")
    d.feed(ids[:k] + other)
    fresh = Detokenizer(decode, ["more"])
    fresh.feed(ids[:k] + other)
    assert (d.text, d.marks, d.stop_at, d.cut) == (fresh.text, fresh.marks, fresh.stop_at, fresh.cut)
    assert d.stop_at == k + len(other)


def test_each_tokens_offset_counts_the_characters_before_it(llm, decode):
    """A token holding part of a character adds nothing to the offset; the one completing it adds the
    character (the emoji is 1 character, whatever its byte tokens)."""
    ids = llm.tokenizer.encode("a 🎉 b")
    d = Detokenizer(decode)
    d.feed(ids)
    assert len(ids) == 5 and d.text == "a 🎉 b"
    assert d.offsets(0, len(ids)) == [0, 1, 2, 2, 3]  # "a", " " + a byte, two bytes, " b"


@pytest.mark.parametrize("stop", ["", ["a", ""], [3], 7])
def test_a_bad_stop_names_the_field(stop):
    with pytest.raises(SamplingError) as exc:
        SamplingParams(stop=stop)
    assert exc.value.option == "stop"


# --- the engine, LLM and the CLI ---------------------------------------------------------------------

def engine_run(llm, prompt_ids, policy, stop, speculative=None, others=()):
    """One request with a stop string (beside `others`, without one, in the same batch): its text, ids,
    (token, logprob) pairs, finish reason, and the text its stream's deltas add up to."""
    req = Request(prompt_ids, 40, policy, sampling=SamplingParams(logprobs=2, stop=(stop,)), speculative=speculative,
                  request_id="stopping")
    batch = [req, *(Request(ids, 24, policy, request_id=f"other{i}") for i, ids in enumerate(others))]
    events = [e for e in llm.engine.stream(batch) if e.request_id == "stopping"]
    r = events[-1].result
    streamed = "".join(e.text for e in events)
    return r.text, r.token_ids, [(t.token, t.logprob, t.top) for t in r.logprobs], r.finish_reason, streamed


def test_llm_generate_returns_the_text_cut_before_the_stop(llm):
    """`LLM.generate`'s text ends before the stop string (accented here); its ids end with the token that
    completes it."""
    full = llm.generate(chat(FRENCH), max_new_tokens=24)[0]
    assert "ç" in full.text, full.text
    cut = llm.generate(chat(FRENCH), max_new_tokens=24, sampling=SamplingParams(stop=("ç",)))[0]
    assert cut.text == full.text[:full.text.index("ç")] and cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and "ç" in llm.tokenizer.decode(cut.token_ids)


def test_the_cli_prints_the_text_cut_before_the_stop(llm, capsys):
    full = llm.generate(chat(FRENCH), max_new_tokens=24, policy=llm.policy("reference"))[0].text
    assert "café" in full
    code = main(["generate", FRENCH, "--stop", "café", "--max-new-tokens", "24", "--policy", "reference", "--json"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert code == 0 and row["text"] == full[:full.index("café")] and row["finish_reason"] == "stop"


@pytest.mark.slow  # every policy in turn (the issue case under every policy stays)
def test_stop_text_and_logprobs_equal_reference_alone_under_every_policy(llm):
    """The stop request alone under `reference` is the answer; under every deterministic policy beside two
    other requests, under margin with a flip injected before the stop (repaired by a rollback), and
    speculating: the same text, ids and logprobs bitwise; each stream's deltas add up to the text."""
    ids, others = chat_ids(llm, FRENCH), [chat_ids(llm, "Name a color."), llm.tokenizer.encode(ANIMALS)]
    want = engine_run(llm, ids, llm.policy("reference"), "café")
    assert want[3] == "stop" and want[0] == want[4] and want[0] and "café" not in want[0], want
    for policy in POLICIES:
        assert engine_run(llm, ids, llm.policy(policy), "café", others=others) == want, policy
    flip = llm.policy("margin", inject_flip_at=3)
    got = engine_run(llm, ids, flip, "café", others=others)
    assert got == want
    spec = engine_run(llm, ids, llm.policy("batch-invariant"), "café", SpeculativeConfig("ngram", num_tokens=8),
                      others=others)
    assert spec == want


def test_the_injected_flip_is_repaired_by_a_rollback(llm):
    """The case above ran: the flip changed a token before the stop and a rollback repaired it."""
    req = Request(chat_ids(llm, FRENCH), 40, llm.policy("margin", inject_flip_at=3),
                  sampling=SamplingParams(stop=("café",)))
    r = llm.engine.generate([req])[0]
    assert r.stats["rollbacks"] >= 1 and r.finish_reason == "stop", r.stats


def test_speculation_past_the_stop_string_is_cut(llm, monkeypatch):
    """A speculative step accepts several tokens; the stop string completes inside them: the output ends
    at the completing token, as plain decoding's does (and the cut really happened inside a step)."""
    monkeypatch.setattr(llm.engine, "config", dataclasses.replace(llm.engine.config, speculative_cost_model=False))
    ids = chat_ids(llm, "Copy this sentence twice: The quick brown fox jumps over the lazy dog.")
    stop = "jumps"
    cuts = []
    feed = Detokenizer.feed
    monkeypatch.setattr(Detokenizer, "feed", lambda self, out: cuts.append((len(out), feed(self, out))) or cuts[-1][1])
    spec = engine_run(llm, ids, llm.policy("batch-invariant"), stop, SpeculativeConfig("ngram", num_tokens=8))
    assert any(keep is not None and keep < n for n, keep in cuts), cuts  # accepted past the stop, then cut
    plain = engine_run(llm, ids, llm.policy("batch-invariant"), stop)
    assert spec == plain and plain[3] == "stop" and stop not in plain[0]
    assert stop in llm.tokenizer.decode(plain[1]) and stop not in llm.tokenizer.decode(plain[1][:-1])

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


def test_n_samples_with_a_stop_are_each_their_own_sample_cut(client):
    """n = 3 sampled answers with a stop string, whole and streamed: each is the answer without the stop
    string cut before its first one (the samples' tokens do not depend on the stop)."""
    kw = dict(model=MODEL, prompt=ANIMALS, max_tokens=24, temperature=0.9, seed=5, n=3)
    free = [c.text for c in sorted(client.completions.create(**kw).choices, key=lambda c: c.index)]
    stop = ","
    want = [t[:t.index(stop)] if stop in t else t for t in free]
    assert sum(stop in t for t in free) >= 2 and len(set(free)) > 1, free
    whole = sorted(client.completions.create(**kw, stop=[stop]).choices, key=lambda c: c.index)
    assert [c.text for c in whole] == want
    assert [c.finish_reason for c in whole] == ["stop" if stop in t else "length" for t in free]
    streamed = ["", "", ""]
    for ev in client.completions.create(**kw, stop=[stop], stream=True):
        for c in ev.choices:
            streamed[c.index] += c.text
    assert streamed == want


def test_chat_streaming_with_a_stop_adds_up_to_the_whole_answer(client):
    """Chat, streamed and whole, with an accented stop string: the deltas add up to the whole answer,
    which is the answer without a stop cut before it."""
    kw = dict(model=MODEL, messages=chat(FRENCH), max_tokens=24, temperature=0)
    free = client.chat.completions.create(**kw).choices[0].message.content
    want = free[:free.index("café")]
    whole = client.chat.completions.create(**kw, stop="café").choices[0]
    assert whole.message.content == want and whole.finish_reason == "stop"
    deltas, reasons = [], []
    for ev in client.chat.completions.create(**kw, stop="café", stream=True):
        for c in ev.choices:
            deltas.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(deltas) == want and reasons[-1] == "stop" and len([d for d in deltas if d]) > 1


def test_an_emoji_stop_cuts_inside_a_run_of_byte_tokens(client, llm):
    """The stop string is an emoji whose bytes are spread over several tokens."""
    prompt = "List: a 🎉, b 🎉, c 🎉, d"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16).choices[0].text
    stop = "🎉"
    assert stop in free and len(llm.tokenizer.encode(stop)) > 1, free
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=stop).choices[0]
    assert cut.text == free[:free.index(stop)] and cut.finish_reason == "stop"


def test_the_engine_thread_decodes_without_the_handlers_tokenizer_lock(llm, server, client):
    """A request's text and stop strings are decoded on the engine thread's own tokenizer copy: with the
    lock that HTTP handlers take for the tokenizer held throughout, a request sent as token ids (nothing
    for a handler to encode) still streams, stops at its stop string and answers."""
    ids = llm.tokenizer.encode(ANIMALS)
    with server.state.context.lock:
        r = client.with_options(timeout=60, max_retries=0).completions.create(
            model=MODEL, prompt=ids, max_tokens=64, temperature=0, stop=["Kafeki"],
            extra_body={"determinism": {"policy": "reference"}})
    assert r.choices[0].finish_reason == "stop" and "Kafeki" not in r.choices[0].text
