"""What evaluation harnesses and RL rollouts ask of the server, through the official `openai`
client: logprobs (completions and chat, streamed and not), echo scoring, n samples with
nucleus sampling, several prompts per request; each bitwise equal to the request alone, under
concurrent load, and to `LLM.score` of the same tokens."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from server_fixtures import MODEL, StreamingLoad, chat  # noqa: E402

BI = {"determinism": {"policy": "batch-invariant"}, "ignore_eos": True}
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 30, 2, 198, 1, 4093, 198, 1780, 314, 260,
          3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]  # a chat-templated question, as token ids


def Load(server, clients: int) -> StreamingLoad:  # noqa: N802 (used as a context manager, like a class)
    """`clients` threads streaming sampled chat completions until stopped: other requests share every step."""
    return StreamingLoad(server, clients, max_tokens=24, temperature=0.7)


def completion_logprobs(client, **kw):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, logprobs=5, extra_body=BI, **kw)
    c = r.choices[0]
    return c.model_extra["token_ids"], c.logprobs.token_logprobs, c.logprobs.top_logprobs, r


def test_completion_logprobs_alone_loaded_streamed_and_scored(llm, client, server):
    ids, lps, tops, r = completion_logprobs(client)
    assert len(lps) == len(ids) == 12 and all(len(t) == 5 for t in tops)
    assert r.model_extra["determinism"]["logprobs_guaranteed"] is True
    with Load(server, 8) as load:
        loaded = completion_logprobs(client)[:3]
    assert load.done > 0 and loaded == (ids, lps, tops)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, logprobs=5, stream=True,
                                            extra_body=BI))
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lps
    assert llm.score(PROMPT, ids).logprobs == lps  # the rollout / trainer match


def test_chat_logprobs_shape_and_stream(client):
    kw = dict(model=MODEL, messages=chat("Name a color."), max_tokens=8, logprobs=True, top_logprobs=3,
              extra_body=BI)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 8
    for t in whole:
        assert isinstance(t.token, str) and isinstance(t.bytes, list) and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
    streamed = [t for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]


def test_echo_scores_the_prompt_as_llm_score_does(llm, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "length" and len(lp.tokens) == len(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == llm.score(PROMPT[:1], PROMPT[1:]).logprobs
    text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, echo=True)
    assert text.choices[0].text.startswith("The capital of France is")


def sample_tokens(client, n=4, seed=7):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=n, temperature=1.0, top_p=0.9,
                                  seed=seed, extra_body=BI)
    return [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]


def test_n_samples_equal_their_single_twins_alone_and_loaded(client, server):
    samples = sample_tokens(client)
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    assert [sample_tokens(client, n=1, seed=7 + i)[0] for i in range(4)] == samples  # sample i: seed + i
    with Load(server, 8):
        assert sample_tokens(client) == samples


def test_several_prompts_in_one_request(client):
    prompts = ["Once upon a time", "The answer is", "def fib(n):"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, extra_body=BI)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices):
        single = client.completions.create(model=MODEL, prompt=p, max_tokens=6, extra_body=BI).choices[0]
        assert c.text == single.text
    assert r.usage.prompt_tokens == sum(client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage
                                        .prompt_tokens for p in prompts)


def test_chat_n_samples_streamed_equal_whole(client):
    kw = dict(model=MODEL, messages=chat("Say something about cats."), max_tokens=8, n=2, temperature=1.0,
              seed=3, extra_body=BI)
    whole = client.chat.completions.create(**kw)
    texts = {c.index: c.message.content for c in whole.choices}
    streamed = {0: "", 1: ""}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert sorted(texts) == [0, 1] and streamed == texts


def test_text_offset_counts_characters_over_an_emoji_split_into_byte_tokens(llm, client):
    """Completions' `text_offset` is each token's start in the returned text, in characters: the byte
    tokens of one emoji share the offset where the emoji begins (a partial character adds nothing), the
    next token's is one further. The same echoed (prompt tokens, then the completion's after the prompt's
    text), streamed and whole."""
    prompt = "🎉🎉"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, logprobs=1, extra_body=BI)
    whole = client.completions.create(**kw).choices[0]
    ids, text = whole.model_extra["token_ids"], whole.text
    assert text.startswith("🎉") and len(ids) > len(text), text  # several tokens per character
    # what the tokens before each one decode to, in complete characters
    want = [len(llm.tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert whole.logprobs.text_offset == want and want[:4] == [0, 0, 0, 1]
    streamed = [x for ch in client.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.text_offset]
    assert streamed == want
    echoed = client.completions.create(**kw, echo=True).choices[0].logprobs.text_offset
    n = len(echoed) - len(ids)
    assert echoed == [0, 0, 0, 1, 1, 1][:n] + [len(prompt) + i for i in want] and n == 6
