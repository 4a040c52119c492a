"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1, its life beyond one good request:
client disconnects, a full queue, engine faults, the API key and the default policy, graceful shutdown
(in process and `margingate serve` under SIGTERM). The incremental detokenizer: `test_stop_strings.py`.

Each server here runs its own small engine over the session's model; the shared fixtures (`server`,
`http`, `server_idle_after`) and helpers are in `server_fixtures.py`.
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
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from server_fixtures import MODEL, TIMEOUT, is_idle, make_server, poll, sse_events  # noqa: E402

from margingate.server.core.config import ServerConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("server_idle_after")


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
        assert server.engine.load.blocks_used > 0  # it holds KV blocks
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
    assert not srv.state.worker.alive and srv.engine.load.blocks_used == 0
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
    assert not srv.state.worker.alive and srv.engine.load.blocks_used == 0 and not srv.engine.has_work


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
                             "--max-model-len", "256", "--max-num-seqs", "2", "--log-level", "warning"],
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

