"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1: the official `openai` client,
determinism under concurrent load, streaming, and every bad input. Disconnects, overload, engine
faults, auth and shutdown are in `test_server_lifecycle.py`.

Each server here runs its own small engine (KV slots, 512 positions) over the session's model; the shared
fixtures (`server`, `http`, `client`, `server_idle_after`) and helpers are in `server_fixtures.py`.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from server_fixtures import MODEL, TIMEOUT, chat  # noqa: E402

from margingate.options import DEFAULT_DEFER  # noqa: E402

pytestmark = pytest.mark.usefixtures("server_idle_after")


# --- the openai client ---------------------------------------------------------------------

def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = http.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    from margingate.kernels import invariant
    # the linear path in use and the refused ones (none here: tests/test_linear_proof.py makes one refuse)
    assert h.json()["linear_path"] == invariant.path_in_use("bf16") and h.json()["linear_refused"] == {}
    assert h.json()["quantized_contract"] == "int8" and h.json()["int8_path"] == invariant.path_in_use("int8")
    assert h.json()["int8_path"] in invariant.PATHS["int8"]
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert http.get("/v1/models/nope").status_code == 404


def test_completion_with_report(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                  extra_body={"deterministic": True})
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert r.usage.completion_tokens == len(choice.token_ids) and r.usage.prompt_tokens > 0
    report = r.model_extra["determinism"]
    # `auto`: on CPU the invariant kernels are the cheapest guarantee (README, "auto")
    assert report["deterministic"] and report["policy"] == "batch-invariant" and report["chosen_by"] == "auto"
    assert report["batch_invariant"] is True and report["guaranteed"] is True
    assert isinstance(report["steps"], int)
    margin = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                       extra_body={"determinism": {"policy": "margin"}}).model_extra["determinism"]
    assert margin["policy"] == "margin" and "chosen_by" not in margin and margin["strict"] is True
    assert margin["tau"] == margin["environment"]["default_tau"]
    for key in ("triggers", "repairs", "rollbacks", "replayed_tokens", "steps"):
        assert isinstance(margin[key], int)
    assert report["environment"]["model"] == MODEL and r.system_fingerprint


def test_chat_stream_equals_non_stream(client):
    """A strict stream releases verified tokens only: the same tokens as the non-streamed answer."""
    kw = dict(model=MODEL, messages=chat("Name three primary colors."), max_tokens=12,
              extra_body={"determinism": {"policy": "margin", "strict": True}})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert text == whole.choices[0].message.content
    assert ids == whole.choices[0].token_ids
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["determinism"]["strict"] is True
    assert chunks[-1].usage.completion_tokens == len(ids)  # include_usage: a last chunk without choices


def test_streams_are_strict_unless_asked(client, http):
    """A deterministic stream releases verified tokens only, as the non-streamed answer does. Non-strict
    is an explicit opt-in that promises nothing: the report says so, and `"deterministic": true` with it
    is refused, naming `strict` (it was accepted, then reported as not guaranteed)."""
    def final_report(**extra) -> dict:
        chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, stream=True,
                                                extra_body=extra))
        return [c for c in chunks if c.choices[0].finish_reason][0].model_extra["determinism"]

    strict = final_report(deterministic=True, determinism={"policy": "margin"})
    assert strict["strict"] is True and strict["guaranteed"] is True and strict["deterministic"] is True
    loose = final_report(determinism={"policy": "margin", "strict": False})
    assert loose["strict"] is False and loose["deterministic"] is False and loose["guaranteed"] is False
    for block, option in (({"policy": "margin", "strict": False}, "strict"),
                          ({"policy": "margin", "repair": "column"}, "repair")):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 6,
                                               "deterministic": True, "determinism": block})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"determinism.{option}", r.text


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12)
    text = base.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_non_deterministic_seeded_sampling_reports_its_seed(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.9)
    report = r.model_extra["determinism"]
    assert report["deterministic"] is False and report["policy"] == "fast"
    assert isinstance(report["seed"], int)  # drawn by the server: the sample can be replayed
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0.9,
                                      seed=report["seed"])
    assert again.choices[0].token_ids == r.choices[0].token_ids


# --- the promise: the same tokens whatever shares the batch ----------------------------------

def test_deterministic_alone_equals_under_concurrent_streams(server, client, prompts):
    greedy = dict(model=MODEL, messages=chat("Explain why the sky is blue, briefly."), max_tokens=12,
                  extra_body={"deterministic": True, "ignore_eos": True})
    sampled = dict(model=MODEL, messages=chat("Write a short poem about rivers."), max_tokens=12,
                   temperature=0.8, seed=1234, extra_body={"deterministic": True, "ignore_eos": True})
    alone = [client.chat.completions.create(**kw) for kw in (greedy, sampled)]
    assert all(len(a.choices[0].token_ids) == 12 for a in alone)

    n_streams, started, ends = 8, threading.Barrier(8 + 1, timeout=TIMEOUT), {}

    def background(i: int) -> int:
        p = prompts[(5 * i) % len(prompts)]
        body = dict(model=MODEL, max_tokens=40, stream=True, extra_body={"ignore_eos": True})
        if i % 2:  # half of them deterministic (streaming margin), half fast
            body["extra_body"]["deterministic"] = True
        if p.kind == "chat":
            it = client.chat.completions.create(messages=list(p.messages), **body)
        else:
            it = client.completions.create(prompt=p.text, **body)
        n = 0
        for k, chunk in enumerate(it):
            if k == 0:
                started.wait()
            if chunk.choices:
                n += len(chunk.choices[0].token_ids)
        ends[i] = time.monotonic()
        return n

    with ThreadPoolExecutor(n_streams + 2) as pool:
        streams = [pool.submit(background, i) for i in range(n_streams)]
        started.wait()  # every background stream is generating
        loaded = list(pool.map(lambda kw: client.chat.completions.create(**kw), (greedy, sampled)))
        done_at = time.monotonic()
        assert [s.result(timeout=TIMEOUT) for s in streams] == [40] * n_streams
    for a, b in zip(alone, loaded):
        assert b.choices[0].token_ids == a.choices[0].token_ids
        assert b.choices[0].message.content == a.choices[0].message.content
    assert all(t > done_at for t in ends.values()), "the background streams ended before the probes"
    hist = dict(line.rsplit(" ", 1) for line in server.state.metrics.render().splitlines()
                if line.startswith("margingate_batch_size_bucket"))
    assert int(hist['margingate_batch_size_bucket{le="8"}']) < int(hist['margingate_batch_size_bucket{le="+Inf"}'])


def test_conversation_hits_the_prefix_cache(server, client):
    """A second turn reuses the K/V of the first turn's prompt: counted on /metrics and in usage; streamed
    or not, and again as a whole hit, it gives the same tokens."""
    def hits() -> float:
        return server.state.metrics.value("prefix_cache_hits_total")

    kw = dict(model=MODEL, max_tokens=6, extra_body={"deterministic": True, "ignore_eos": True})
    first = [{"role": "system", "content": "You answer in one short sentence, naming facts only. " * 4},
             {"role": "user", "content": "Name a planet."}]
    before = hits()
    a = client.chat.completions.create(messages=first, **kw)
    second = [*first, {"role": "assistant", "content": a.choices[0].message.content},
              {"role": "user", "content": "And another one?"}]
    b = client.chat.completions.create(messages=second, **kw)
    assert b.usage.prompt_tokens_details.cached_tokens >= 48
    chunks = list(client.chat.completions.create(messages=second, stream=True, **kw))
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == b.choices[0].token_ids
    assert hits() - before >= 2


def test_determinism_options_reach_the_policy(http):
    """`defer` is a request option; `batch_invariant` says whether these options keep the promise."""
    def report(determinism: dict, **fields) -> dict:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "determinism": determinism, **fields}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["determinism"]

    margin = report({"policy": "margin"})
    assert margin["policy"] == "margin" and margin["strict"] is True and margin["defer"] == DEFAULT_DEFER
    assert margin["batch_invariant"] is True and margin["deterministic"] is True
    assert report({"policy": "margin", "defer": 0})["defer"] == 0
    assert report({"policy": "margin", "defer": 3})["defer"] == 3
    assert report({"policy": "margin", "strict": False})["batch_invariant"] is False
    layercast = report({"policy": "layercast"})
    assert layercast["policy"] == "layercast"
    assert layercast["batch_invariant"] is False and layercast["deterministic"] is False
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "1, 2, 3, 1, 2, 3, 1, 2,", "max_tokens": 8,
                                               "deterministic": True}).json()
    spec = report({"policy": "batch-invariant"}, prompt="1, 2, 3, 1, 2, 3, 1, 2,", max_tokens=8,
                  speculative={"method": "ngram", "num_tokens": 3})
    # proposals fed, or held by the step cost model (the server's engine has a profile by now)
    assert spec["speculation_exact"] is True and spec["proposed_tokens"] + spec["speculation_held_steps"] > 0
    again = http.post("/v1/completions", json={"model": MODEL, "prompt": "1, 2, 3, 1, 2, 3, 1, 2,", "max_tokens": 8,
                                               "deterministic": True, "speculative": {"num_tokens": 3}}).json()
    assert again["choices"][0]["text"] == plain["choices"][0]["text"]


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "malformed JSON"),
    (b"", 400, "empty"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "NaN"),
    (b"[1, 2]", 400, "JSON object"),
    (b'"just a string"', 400, "JSON object"),
    (b"\xff\xfe", 400, "UTF-8"),
])
def test_malformed_bodies(http, body, status, needle):
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


@pytest.mark.parametrize("fields, param, needle", [
    ({"max_tokens": 0}, "max_tokens", "only meaningful with echo"),
    ({"max_tokens": "8"}, "max_tokens", "integer"),
    ({"temperature": -0.5}, "temperature", "[0, 2]"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": 7}, "temperature", "[0, 2]"),
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"min_p": -0.1}, "min_p", "[0, 1]"),
    ({"top_k": -2}, "top_k", "top_k must be an integer"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 10]"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"the": 1}}, "logit_bias", "token ids"),
    ({"best_of": 3}, "best_of", "best_of = n"),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"echo": True, "n": 2, "logprobs": 1}, "echo", "n > 1"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"stream": "yes"}, "stream", "boolean"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"seed": 2 ** 70}, "seed", "64-bit"),
    ({"determinsm": {}}, "determinsm", "unknown field"),
    ({"determinism": {"policy": "magic"}}, "determinism.policy", "unknown policy"),
    ({"determinism": {"strict": "no"}}, "determinism.strict", "boolean"),
    ({"determinism": {"tau": -1}}, "determinism.tau", "tau must be a number >= 0"),
    ({"determinism": {"repair": "glue"}}, "determinism.repair", "unknown repair"),
    ({"determinism": {"window": 0}}, "determinism.window", "dvr window must be an integer >= 1"),
    ({"determinism": {"window": 257}}, "determinism.window", "dvr window must be an integer <= 256"),
    ({"determinism": {"group": 65}}, "determinism.group", "dvr group must be an integer <= 64"),
    ({"determinism": {"policy": "margin", "defer": -1}}, "determinism.defer", "defer must be an integer >= 0"),
    ({"determinism": {"policy": "margin", "defer": 1025}}, "determinism.defer", "<= 1024"),
    ({"determinism": {"verifier_precision": "fp8"}}, "determinism.verifier_precision", "unknown verifier precision"),
    ({"determinism": {"policy": "margin", "bogus": 1}}, "determinism.bogus", "unknown field"),
    ({"speculative": {"num_tokens": 0}}, "speculative.num_tokens", "num_tokens must be an integer in [1, 16]"),
    ({"speculative": {"method": "medusa"}}, "speculative.method", "unknown speculative method"),
    ({"speculative": {"method": "draft"}}, "speculative.method", "needs a draft model"),
    ({"deterministic": False, "determinism": {"policy": "margin"}}, "deterministic", "contradicts"),
    ({"deterministic": True, "determinism": {"policy": "fast"}}, "determinism.policy", "batch-invariant"),
    ({"deterministic": True, "determinism": {"policy": "layercast"}}, "determinism.policy", "promises determinism"),
    ({"deterministic": True, "temperature": 0.7}, "seed", "needs a seed"),
    ({"determinism": {"policy": "dvr"}, "temperature": 1.0}, "seed", "needs a seed"),
    ({"prompt": ["x"] * 65}, "prompt", "at most 64 prompts"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1, "x"]}, "prompt", "token ids"),
    ({"prompt": None}, "prompt", "required"),
])
def test_bad_fields_name_the_problem(http, fields, param, needle):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_bad_chat_bodies(http):
    for messages, needle in [([], "at least 1"), ([{"role": "robot", "content": "x"}], "role"),
                             ([{"role": "tool", "content": "x"}], "tool_call_id"),
                             ([{"role": "user"}], "content"), ("hi", "list")]:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("x"), "max_tokens": 2,
                                                "max_completion_tokens": 3})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]
    for fields, param, needle in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
                                  ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
                                  ({"echo": True}, "echo", "not supported on chat")]:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("x"), **fields})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and needle in err["message"], (fields, err)


def test_too_long_prompt_and_bad_token_ids(http, client, server):
    long_prompt = "word " * (server.engine.max_len + 10)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4})
    assert r.status_code == 400 and "longer than the context" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4,
                                           "stream": True})
    assert r.status_code == 400 and "longer than the context" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="longer than the context"):
        client.chat.completions.create(model=MODEL, messages=chat(long_prompt), max_tokens=4)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": server.engine.max_len})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "at most" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 10 ** 9], "max_tokens": 4})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": [[504, 3575]], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 2


def test_unknown_model_route_method_and_size(http):
    r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/completions").status_code == 405
    big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_metrics_exposition(http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "deterministic": True})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("http_requests_total", "requests_finished_total", "prompt_tokens_total",
                 "generation_tokens_total", "batch_size_bucket", "determinism_triggers_total",
                 "determinism_repairs_total", "determinism_rollbacks_total", "queue_length",
                 "request_latency_seconds_bucket", "time_to_first_token_seconds_count", "kv_blocks_free"):
        assert f"margingate_{name}" in text, name
    assert 'margingate_requests_finished_total{finish_reason="length",policy="batch-invariant"}' in text
    for name in ("prefix_cache_hits_total", "prefix_cache_misses_total", "prefix_cache_reused_tokens_total",
                 "prefix_cache_tokens"):
        assert f"margingate_{name}" in text, name
    assert 'margingate_http_requests_total{code="400",route="/v1/completions"}' in text


def test_fields_sdks_send_are_accepted_and_do_what_they_say(http):
    """store, metadata, service_tier, prompt_cache_key and safety_identifier change no token here and are
    accepted (clients send them unasked); `developer` is the system role under its newer name (the same
    tokens); max_completion_tokens bounds a completion too (issue 47)."""
    sdk = {"store": False, "metadata": {"run": "eval-7"}, "service_tier": "auto", "prompt_cache_key": "k1",
           "safety_identifier": "u-1"}
    replies = {}
    for role in ("system", "developer"):
        messages = [{"role": role, "content": "Answer in one word."}, *chat("What colour is the sky?")]
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 6,
                                                    "temperature": 0, **sdk})
        assert r.status_code == 200, r.text
        replies[role] = r.json()["choices"][0]["message"]["content"]
    assert replies["developer"] == replies["system"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "The sea is", "max_completion_tokens": 3,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "max_completion_tokens": 3})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]


def test_cached_tokens_never_exceed_the_prompt_with_n_samples(http):
    """n samples share one prefill: the siblings' forks of it are not counted again (issue 47)."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("Name three rivers."), "n": 3,
                                                "temperature": 0.8, "seed": 1, "max_tokens": 3})
    usage = r.json()["usage"]
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage
