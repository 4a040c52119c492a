"""What the server tests share (`test_server.py`, `test_server_logprobs.py`, `test_server_fuzz.py`): a real
uvicorn on 127.0.0.1 over the session's model, its clients, and small helpers. The fixtures `server`,
`http` and `client` are registered for every module by `conftest.py`; a module may override `server`
(the fuzz runs a smaller one) and keeps `http` and `client`.

The server packages (fastapi, uvicorn, httpx, openai) are imported only when a fixture or helper runs:
each server test module skips itself first when one is missing.
"""
from __future__ import annotations

import json
import time

import pytest

MODEL = "smollm2-135m"
SLOTS = 12
TIMEOUT = 180.0  # generous: the machine may be shared


def make_server(llm, *, slots: int = SLOTS, max_len: int = 512, grace_s: float = 10.0,
                prefix_cache_tokens: int = 2048, **app_kw):
    """A started server with its own small engine (`slots` KV slots) over the session's model; the prefix
    cache on by default, as `margingate serve` runs. `srv.app`, `srv.state`, `srv.engine` for the tests."""
    from margingate.engine.detokenize import text_decoder
    from margingate.engine.engine import Engine, EngineConfig
    from margingate.server.app import create_app
    from margingate.server.background import BackgroundServer

    engine = Engine(llm.model, EngineConfig(max_num_seqs=slots, max_model_len=max_len,
                                            prefix_cache_tokens=prefix_cache_tokens,
                                            num_threads=llm.engine.num_threads), lambda: llm.policy("fast"),
                    detokenize=text_decoder(llm.tokenizer), grammars=llm.grammars)
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
    return (e.load.blocks_used == 0 and not e.has_work
            and srv.state.worker.in_flight == 0)


def sse_events(response) -> list:
    """Parsed `data:` payloads of an SSE response ("[DONE]" kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def agents_against(url: str):
    """openai-agents' module, its default client pointed at `url` (a server's) over the Responses API, tracing
    off; a generator for a fixture: the default client is put back after the test."""
    import openai

    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install openai-agents)")
    from agents.models import _openai_shared

    before = _openai_shared.get_default_openai_client()
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")
    yield agents
    _openai_shared.set_default_openai_client(before)


def weather_agent(agents, model, answer: str = "sunny, 21 degrees", **behaviour):
    """openai-agents' `agents` module, a weather tool answering `answer`, and a factory of agents over `model`
    (a name, or a model object) that use it: (the cities asked so far, agent(**model settings))."""
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return answer

    def agent(**settings):
        return agents.Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                            model=model, model_settings=agents.ModelSettings(
                                max_tokens=48, extra_body={"determinism": {"policy": "batch-invariant"}}, **settings),
                            **behaviour)
    return asked, agent


@pytest.fixture(scope="module")
def server(llm):
    """One server per module: SLOTS slots, 512 positions, a queue of 32."""
    srv = make_server(llm, max_queue=32)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture
def server_idle_after(request):
    """Whatever a test did, the module's shared server must come back to idle: every slot free, nothing
    queued (a module asks for it with `pytestmark = pytest.mark.usefixtures("server_idle_after")`)."""
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        assert poll(lambda: is_idle(srv), 60), (srv.engine.load, srv.state.worker.in_flight)
        assert srv.state.worker.alive


class StreamingLoad:
    """`clients` threads streaming chat completions (`create`: the request's keyword arguments) until the
    block ends, so other requests share every step; `done` counts the finished streams."""

    def __init__(self, server, clients: int, model: str = MODEL, **create):
        import threading

        import openai

        self.stop, self.done = threading.Event(), 0
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)

        def loop(i):
            while not self.stop.is_set():
                for _ in c.chat.completions.create(model=model, messages=chat(f"Tell me fact {i} about rivers."),
                                                   stream=True, **create):
                    pass
                self.done += 1
        self.threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=TIMEOUT)
