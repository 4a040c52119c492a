"""Fuzzing the server's request bodies (hypothesis) against a real uvicorn on 127.0.0.1:
whatever arrives, the answer is never a 5xx, the server never crashes, the engine returns to idle,
and a deterministic request still gets the same tokens afterwards."""
from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_fixtures import MODEL, make_server  # noqa: E402

from margingate.options import PROMISES, REPAIRS  # noqa: E402

EXAMPLES = int(os.environ.get("MARGINGATE_FUZZ_EXAMPLES", "40"))  # raise it for a longer fuzz
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

# --- strategies ------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def maybe(valid):
    """Mostly plausible values, sometimes anything."""
    return st.one_of(valid, valid, valid, json_values)


# small outputs only: a fuzz case costs at most a few decode steps
max_tokens = st.integers(-3, 4) | st.integers(10 ** 6, 10 ** 7) | st.floats(0, 5) | st.just("3")
temperature = st.floats(-1, 3, allow_nan=False) | st.sampled_from([0, 1e-300, 1e-6, 2])
determinism = st.fixed_dictionaries({}, optional={
    "policy": maybe(st.sampled_from([*PROMISES, "nope"])),
    "tau": maybe(st.floats(-1, 5, allow_nan=False) | st.just(0)),
    "repair": maybe(st.sampled_from([*REPAIRS, "glue"])),
    "strict": maybe(st.booleans()),
    "verifier_precision": maybe(st.sampled_from(["bf16", "fp32", "fp8"])),
    "defer": maybe(st.integers(-1, 2000)),
    "window": maybe(st.integers(-1, 300)),
    "group": maybe(st.integers(-1, 70)),
})
common = {
    "model": st.sampled_from([MODEL, MODEL, "gpt-4", ""]) | json_values,
    "max_tokens": max_tokens,
    "temperature": maybe(temperature),
    "seed": maybe(st.integers(-2 ** 64, 2 ** 64)),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": maybe(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5)),
    "n": maybe(st.integers(-1, 3)),
    "top_p": maybe(st.floats(0, 1)),
    "top_k": maybe(st.integers(-2, 60000)),
    "min_p": maybe(st.floats(-0.5, 1.5)),
    "presence_penalty": maybe(st.floats(-3, 3)),
    "repetition_penalty": maybe(st.floats(-1, 3)),
    "logit_bias": maybe(st.dictionaries(st.text(max_size=6), st.floats(-200, 200) | json_values, max_size=3)),
    "logprobs": maybe(st.integers(-1, 25) | st.booleans()),
    "top_logprobs": maybe(st.integers(-1, 25)),
    "echo": maybe(st.booleans()),
    "deterministic": maybe(st.booleans()),
    "determinism": maybe(determinism),
    "ignore_eos": maybe(st.booleans()),
    "user": maybe(st.text(max_size=5)),
}
text_prompt = st.text(max_size=60) | st.sampled_from(["Hello", "1 + 1 =", "<|im_start|>user"])
prompt = maybe(text_prompt | st.lists(st.integers(-10, 60000), max_size=6)
               | st.lists(text_prompt, min_size=1, max_size=3)
               | st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=2))
message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["system", "user", "assistant", "tool"])),
                                 "content": maybe(text_prompt | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": text_prompt}),
                                     max_size=2))},
                                optional={"name": st.text(max_size=4)})


def body(required: dict):
    """Required keys, any subset of the known fields, and sometimes one unknown field."""
    return st.fixed_dictionaries(required, optional=common).flatmap(
        lambda d: st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in d), json_values,
                                  max_size=1).map(lambda extra: {**d, **extra}) | st.just(d))


completion_bodies = body({"prompt": prompt})
chat_bodies = body({"messages": maybe(st.lists(message, max_size=3))})

# well-formed bodies: most reach the engine, with every policy, sampling, streaming and stop strings
valid_determinism = st.fixed_dictionaries({}, optional={
    "policy": st.sampled_from(list(PROMISES)), "tau": st.floats(0, 5), "repair": st.sampled_from(REPAIRS),
    "strict": st.booleans(), "verifier_precision": st.sampled_from(["bf16", "fp32"]),
    "defer": st.integers(0, 4), "window": st.integers(1, 8), "group": st.integers(1, 4)})
valid_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 4),
     "prompt": text_prompt.filter(str.strip) | st.lists(st.integers(0, 49151), min_size=1, max_size=6)},
    optional={"temperature": st.sampled_from([0, 1e-6, 0.5, 2]) | st.floats(0, 2),
              "seed": st.integers(-2 ** 63, 2 ** 63 - 1), "stream": st.booleans(),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
              "stop": st.text(min_size=1, max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=4),
              "deterministic": st.booleans(), "determinism": valid_determinism, "ignore_eos": st.booleans(),
              "n": st.integers(1, 3), "top_p": st.floats(0.05, 1), "top_k": st.integers(0, 50),
              "min_p": st.floats(0, 0.5), "frequency_penalty": st.floats(-2, 2),
              "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
              "logprobs": st.integers(0, 5), "echo": st.booleans()})


# --- the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llm):
    """A smaller server than the shared one (4 slots, 128 positions, no prefix cache); `http` is the shared
    fixture's client of it."""
    srv = make_server(llm, slots=4, max_len=128, prefix_cache_tokens=0, max_queue=8, default_max_tokens=4)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(http):
    """A deterministic request before the fuzz: it must come out the same after it."""
    body = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 8, "deterministic": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    return body, r.json()["choices"][0]["token_ids"]


def check(r: httpx.Response, streamed: bool) -> None:
    hypothesis.event(f"HTTP {r.status_code}{' stream' if streamed else ''}")
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"]
        return
    if streamed:
        lines = [x for x in r.text.split("\n") if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]", r.text
        for line in lines[:-1]:
            event = json.loads(line[6:])
            assert "error" not in event or not str(event["error"].get("code", "")).startswith("5"), event
    else:
        data = r.json()
        assert all(c["finish_reason"] in ("stop", "length") for c in data["choices"])
        assert data["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in data["choices"])
        for c in data["choices"]:  # one logprob per token, where asked for
            lp = c.get("logprobs")
            if lp and "content" in lp:
                assert len(lp["content"]) == len(c["token_ids"])


def post(http, path: str, payload) -> None:
    if isinstance(payload, (bytes, str)):
        r = http.post(path, content=payload, headers={"content-type": "application/json"})
        check(r, False)
        return
    r = http.post(path, json=payload)
    check(r, r.headers.get("content-type", "").startswith("text/event-stream"))


@FUZZ
@given(payload=completion_bodies)
def test_fuzz_completions(http, reference, payload):
    post(http, "/v1/completions", payload)


@FUZZ
@given(payload=valid_bodies)
def test_fuzz_well_formed_completions(http, reference, payload):
    post(http, "/v1/completions", payload)


@FUZZ
@given(payload=chat_bodies)
def test_fuzz_chat(http, reference, payload):
    post(http, "/v1/chat/completions", payload)


@settings(FUZZ, max_examples=EXAMPLES * 3 // 2)
@given(raw=st.binary(max_size=64) | json_values.map(json.dumps)
       | st.text(max_size=40).map(lambda t: '{"prompt": "' + t))
def test_fuzz_raw_bodies(http, reference, raw):
    post(http, "/v1/completions", raw)
    post(http, "/v1/chat/completions", raw)


def test_fuzz_left_the_server_sound(server, http, reference):
    deadline = time.monotonic() + 60
    while (server.state.worker.in_flight or server.engine.has_work) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.state.worker.alive and http.get("/health").json()["status"] == "ok"
    assert server.engine.load.blocks_used == 0
    body, tokens = reference
    assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == tokens
    metrics = http.get("/metrics").text
    assert "margingate_engine_step_errors_total 0" in metrics
    assert not [line for line in metrics.splitlines()
                if line.startswith("margingate_http_requests_total") and 'code="5' in line]
