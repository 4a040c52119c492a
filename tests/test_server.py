"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1: the official `openai` client,
determinism under concurrent load, streaming, every error path, disconnects and shutdown.

Each server here runs its own small engine (KV slots, 512 positions) over the session's model.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from margingate.engine import Engine, EngineConfig  # noqa: E402
from margingate.policies import DEFAULT_DEFER  # noqa: E402
from margingate.server.app import create_app  # noqa: E402
from margingate.server.background import BackgroundServer  # noqa: E402
from margingate.server.config import ServerConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
SLOTS = 12
TIMEOUT = 180.0  # generous: the machine may be shared


def make_server(llm, *, slots: int = SLOTS, max_len: int = 512, grace_s: float = 10.0, **app_kw):
    # the prefix cache on, as `margingate serve` runs by default
    engine = Engine(llm.model, EngineConfig(max_batch_size=slots, max_model_len=max_len, prefix_cache_tokens=2048,
                                            num_threads=llm.engine.num_threads), lambda: llm.policy("fast"))
    app_kw.setdefault("default_max_tokens", 16)
    app = create_app(llm, engine=engine, **app_kw)
    srv = BackgroundServer(app, grace_s=grace_s)
    srv.app, srv.state, srv.engine = app, app.state.server, engine
    return srv.start()


def poll(cond, timeout: float = 60.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def is_idle(srv) -> bool:
    e = srv.engine
    return (e.load.free_slots == e.config.max_batch_size and not e.has_work
            and srv.state.worker.in_flight == 0)


def sse_events(response) -> list:
    """Parsed `data:` payloads of an SSE response ("[DONE]" kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def server(llm):
    srv = make_server(llm, max_queue=32)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _server_idle_after(request):
    """Whatever a test did, the shared server must come back to idle: every slot free, nothing queued."""
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        assert poll(lambda: is_idle(srv), 60), (srv.engine.load, srv.state.worker.in_flight)
        assert srv.state.worker.alive


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- the openai client ---------------------------------------------------------------------

def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = http.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
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
    for messages, needle in [([], "at least 1"), ([{"role": "tool", "content": "x"}], "role"),
                             ([{"role": "user"}], "content"), ("hi", "list")]:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("x"), "max_tokens": 2,
                                                "max_completion_tokens": 3})
    assert r.status_code == 400 and "disagree" in r.json()["error"]["message"]
    for fields, param, needle in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
                                  ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
                                  ({"echo": True}, "echo", "unknown field")]:
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
                 "request_latency_seconds_bucket", "time_to_first_token_seconds_count", "kv_slots_free"):
        assert f"margingate_{name}" in text, name
    assert 'margingate_requests_finished_total{finish_reason="length",policy="batch-invariant"}' in text
    for name in ("prefix_cache_hits_total", "prefix_cache_misses_total", "prefix_cache_reused_tokens_total",
                 "prefix_cache_tokens"):
        assert f"margingate_{name}" in text, name
    assert 'margingate_http_requests_total{code="400",route="/v1/completions"}' in text


# --- disconnects, overload, engine faults ------------------------------------------------------

def test_disconnect_mid_stream_frees_slot(server, http):
    before = server.state.metrics.value("client_disconnects_total")
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for _, line in zip(range(6), lines)]
        assert any(line.startswith("data: ") for line in got)
        assert server.engine.load.free_slots < server.engine.config.max_batch_size  # it holds a slot
    assert poll(lambda: is_idle(server), 30)
    # aborted, not run to its 400 tokens
    assert server.state.metrics.value("client_disconnects_total") == before + 1
    assert server.state.metrics.value("requests_finished_total", finish_reason="disconnect", policy="fast") >= 1


def test_disconnect_non_streaming_frees_slot(server):
    before = server.state.metrics.value("client_disconnects_total")
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(TIMEOUT, read=1.0)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=body)
    assert poll(lambda: is_idle(server), 30)
    assert server.state.metrics.value("client_disconnects_total") == before + 1


def test_queue_full_gets_429_with_retry_after(llm):
    srv = make_server(llm, slots=1, max_queue=1)
    try:
        body = {"model": MODEL, "prompt": "Go on and on.", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            with c.stream("POST", "/v1/completions", json=body) as a:
                assert a.status_code == 200
                a_lines = a.iter_lines()  # keep it: a closed iterator closes the connection
                while not next(a_lines).startswith("data: "):
                    pass  # a is running
                with c.stream("POST", "/v1/completions", json=body) as b:
                    assert b.status_code == 200  # accepted, waiting for the slot
                    r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                    assert r.status_code == 429
                    assert int(r.headers["Retry-After"]) >= 1
                    assert r.json()["error"]["code"] == "queue_full"
                    with pytest.raises(openai.RateLimitError):
                        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0).completions.create(
                            model=MODEL, prompt="x", max_tokens=2)
        assert poll(lambda: is_idle(srv), 30)
        assert srv.state.metrics.value("requests_rejected_total", reason="queue_full") == 2
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                       timeout=TIMEOUT)
        assert r.status_code == 200
    finally:
        srv.stop()


def test_engine_fault_fails_its_requests_and_keeps_serving(server, http, monkeypatch):
    runner, calls = server.engine.runner, {"n": 0}
    real_step = runner.step

    def flaky_step(prefills, decodes):
        calls["n"] += 1
        if calls["n"] == 1:  # the first forward: the prompt's
            raise RuntimeError("injected fault")
        return real_step(prefills, decodes)

    monkeypatch.setattr(runner, "step", flaky_step)
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "deterministic": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert poll(lambda: is_idle(server), 30)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").json()["status"] == "ok"
    assert server.state.metrics.value("engine_step_errors_total") >= 1


def test_engine_fault_mid_stream_sends_error_event(server, http, monkeypatch):
    runner, calls = server.engine.runner, {"n": 0}
    real_step = runner.step

    def flaky_step(prefills, decodes):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step, after tokens went out
            raise RuntimeError("injected decode fault")
        return real_step(prefills, decodes)

    monkeypatch.setattr(runner, "step", flaky_step)
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 12, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "injected decode fault" in events[-2]["error"]["message"]


# --- auth, the server's default policy ------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_server(llm):
    """A small second server: an API key, and dvr as what `"deterministic": true` means."""
    srv = make_server(llm, slots=2, api_key="s3cret", default_policy="dvr", default_max_tokens=4)
    yield srv
    srv.stop()


def test_api_key(keyed_server):
    srv = keyed_server
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        assert c.get("/health").status_code == 200  # health needs no key
        for path in ("/v1/models", "/metrics"):
            r = c.get(path)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT)
    assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_options_without_a_policy_take_the_server_default(keyed_server):
    """`{"determinism": {"tau": ...}}` names no policy: it runs under the server's default (here dvr),
    as `"deterministic": true` does; a policy named in the block still wins."""
    auth = {"Authorization": "Bearer s3cret"}
    with httpx.Client(base_url=keyed_server.url, timeout=TIMEOUT, headers=auth) as c:
        card = c.get(f"/v1/models/{MODEL}").json()
        assert card["determinism"]["default_policy"] == "dvr"

        def report(**fields) -> dict:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, **fields})
            assert r.status_code == 200, r.text
            return r.json()["determinism"]

        for fields in ({"determinism": {"tau": 0.3}}, {"deterministic": True},
                       {"deterministic": True, "determinism": {"strict": True}}):
            rep = report(**fields)
            assert rep["policy"] == "dvr" and rep["deterministic"] is True, (fields, rep)
            assert rep["batch_invariant"] is True
        assert report(determinism={"policy": "margin", "tau": 0.3})["policy"] == "margin"
        assert report()["policy"] == "fast"
    assert poll(lambda: is_idle(keyed_server), 30)


@pytest.mark.parametrize("policy", ["fast", "layercast", "nope"])
def test_default_policy_must_promise_determinism(policy):
    """`"deterministic": true` must never run a policy that does not promise it."""
    with pytest.raises(ValueError, match="default_policy must promise determinism"):
        ServerConfig(default_policy=policy)


# --- shutdown ----------------------------------------------------------------------------------

def _stream_in_thread(url: str, body: dict):
    """Start a streaming request; returns (first-chunk event, result holder, thread)."""
    first, out = threading.Event(), {}

    def run():
        try:
            with httpx.Client(base_url=url, timeout=TIMEOUT) as c, \
                    c.stream("POST", "/v1/completions", json=body) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        first.set()
                out["events"] = events
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc
        finally:
            first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return first, out, t


def test_shutdown_finishes_in_flight_requests(llm):
    srv = make_server(llm, slots=2, grace_s=60)
    body = {"model": MODEL, "prompt": "Keep going.", "max_tokens": 24, "ignore_eos": True, "stream": True}
    first, out, t = _stream_in_thread(srv.url, body)
    assert first.wait(TIMEOUT)
    srv.stop()  # what SIGTERM does
    t.join(TIMEOUT)
    events = out["events"]
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1] if e.get("choices")) == 24
    assert not srv.state.worker.alive and srv.engine.load.free_slots == 2
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=5)


def test_shutdown_fails_requests_past_the_grace_cleanly(llm):
    srv = make_server(llm, slots=2, grace_s=0.5)
    body = {"model": MODEL, "prompt": "Keep going.", "max_tokens": 480, "ignore_eos": True, "stream": True}
    first, out, t = _stream_in_thread(srv.url, body)
    assert first.wait(TIMEOUT)
    t0 = time.monotonic()
    srv.stop()
    t.join(TIMEOUT)
    assert time.monotonic() - t0 < 30
    events = out["events"]
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"] and events[-2]["error"]["code"] == "503"
    assert not srv.state.worker.alive and srv.engine.load.free_slots == 2 and not srv.engine.has_work


@pytest.mark.slow
def test_cli_serve_sigterm(tmp_path):
    """`margingate serve` as a process: loopback, API key, a stream that SIGTERM lets finish, exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MARGINGATE_API_KEY": "k3y"}
    threads = os.environ.get("MARGINGATE_TEST_THREADS", "1")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "margingate", "serve", "--port", str(port), "--threads", threads,
                             "--max-model-len", "256", "--max-batch-size", "2", "--log-level", "warning"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        assert poll(up, 240, 0.25), (tmp_path / "serve.log").read_text()
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0, timeout=TIMEOUT)
        stream = c.completions.create(model=MODEL, prompt="Go", max_tokens=20, stream=True,
                                      extra_body={"ignore_eos": True, "deterministic": True})
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(len(ch.choices[0].token_ids) for ch in chunks) == 20
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


# --- pieces ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stops", [[], ["STOP"], ["世界"], ["🎉"], [", 3"], ["zz", "more"]])
def test_text_assembler_matches_full_decode(llm, stops):
    """Incremental detokenization, in chunks of any size, gives decode(ids) cut at the first stop."""
    import random

    from margingate.server.text import TextAssembler

    rng = random.Random(0)
    for text in ["Hello wörld — ünïcödé 你好世界 🎉🎉 done.\n\nNew", "Count: 1, 2, 3, 4", "a b STOP and more"]:
        ids = llm.tokenizer.encode(text)
        full = llm.tokenizer.decode(ids)
        cuts = [full.find(s) for s in stops if s in full]
        expected = full[:min(cuts)] if cuts else full
        for _ in range(4):
            a, out, i = TextAssembler(llm.tokenizer.decode, stops), "", 0
            while i < len(ids) and not a.stopped:
                k = rng.randint(1, 3)
                out += a.feed(ids[i:i + k])
                i += k
            out += a.flush()
            assert out == expected and a.stopped == bool(cuts)
