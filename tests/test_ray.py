"""Scale-out on a local Ray instance (loopback only, 2 CPUs, shut down after this module): Ray
workers of 1 thread each against the session's local engine at its default threads, a worker
that dies mid-run, and `serve --replicas 2` against the single-process app.

The pool's workers hold the instance's 2 CPUs; the Serve test, last here, takes them back.
"""
from __future__ import annotations

import functools
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

# The slow tier: the Ray instance and its workers take minutes on 2 cores. Ray Serve's pydantic v1 idioms warn.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
ray = pytest.importorskip("ray", reason="the Ray tests need the [ray] extra: pip install 'margingate[ray]'")

from margingate.cli import build_parser  # noqa: E402
from margingate.commands.check import Checker  # noqa: E402
from margingate.distributed.offline import WorkerPool  # noqa: E402
from margingate.engine.detokenize import text_decoder  # noqa: E402
from margingate.engine.engine import Engine, EngineConfig  # noqa: E402
from margingate.environment import contract_part  # noqa: E402
from margingate.options import PolicySpec  # noqa: E402

TOKENS = 16
PROMPTS = [0, 10, 20, 30]  # one per category of the built-in set
WORKER_ARGS = ["generate", "--ray", "--ray-workers", "2", "--threads-per-worker", "1", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_session, llm):
    # shards of 2 prompts: not the local engine's batch (all 4 prompts in one)
    p = WorkerPool(build_parser().parse_args(WORKER_ARGS), workers=2, threads=1, max_num_seqs=4)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def local(llm, prompts):
    """The local engine's JSON lines per policy, computed once."""
    return functools.cache(lambda policy: generate(llm, llm.engine, prompts, policy))


def generate(llm, engine, prompts, policy: str) -> list[dict]:
    """What `margingate generate --json` prints, through `engine` (local, or the pool)."""
    reqs = llm.requests([prompts[i] for i in PROMPTS], max_new_tokens=TOKENS)
    for r in reqs:
        r.policy = llm.policy(PolicySpec(policy))
    out = []
    for i, res in enumerate(engine.generate(reqs)):
        c = llm.completion(i, res)
        out.append({"prompt_index": i, "token_ids": c.token_ids, "text": c.text,
                    "finish_reason": c.finish_reason, "stats": c.stats})
    return out


@pytest.mark.parametrize("policy", ["batch-invariant", "margin"])
def test_workers_equal_the_local_engine(pool, llm, prompts, local, policy):
    expected, remote = local(policy), generate(llm, pool, prompts, policy)
    assert [r["prompt_index"] for r in remote] == list(range(len(PROMPTS)))
    if policy == "batch-invariant":  # its report is the same too (no gate that depends on the batch)
        assert remote == expected
    else:  # margin's triggers and repairs are about the batches it shared; its tokens are not
        drop = lambda rows: [{k: v for k, v in r.items() if k != "stats"} for r in rows]  # noqa: E731
        assert drop(remote) == drop(expected)


def test_check_on_workers_gives_the_local_report(pool, llm, prompts):
    """check's batches run whole on the workers: the same token digest and rates as here."""
    subset = [prompts[i] for i in PROMPTS[:3]]

    def report(on):
        return Checker(llm, subset, lambda: llm.policy("margin"), lambda: llm.policy("reference"), 8,
                       progress=False, pool=on).run([2], ["hetero", "staggered"])

    local, remote = report(None), report(pool)
    assert remote["tokens_sha256"] == local["tokens_sha256"]
    for key in ("runs", "sequence_determinism", "flips"):
        assert remote[key] == local[key], key
    assert local["sequence_determinism"] == 1.0


def test_a_worker_killed_mid_run_loses_and_duplicates_nothing(pool, llm, prompts, local, capsys):
    restarts = pool.restarts
    pool.crash_next = 3  # the first shard's worker exits after 3 of its engine's events
    got = generate(llm, pool, prompts, "batch-invariant")
    assert pool.restarts == restarts + 1, "the injected crash did not happen"
    assert "a Ray worker died" in capsys.readouterr().err
    assert [r["prompt_index"] for r in got] == list(range(len(PROMPTS)))  # each answered exactly once
    assert got == local("batch-invariant")
    assert ray.get([a.environment.remote() for a in pool.actors])  # the fresh worker serves


def finished(metrics_text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith("margingate_requests_finished_total{"))


def poll(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_replicas_answer_as_the_single_process_server(pool, llm, prompts):
    httpx = pytest.importorskip("httpx")
    from fastapi.testclient import TestClient
    from ray import serve

    from margingate.distributed.serve import APP_NAME, deployment
    from margingate.server.app import create_app
    from margingate.server.core.config import ServerConfig

    pool.shutdown()  # the replicas take the instance's 2 CPUs
    port = _free_port()
    args = build_parser().parse_args(["serve", "--replicas", "2", "--threads", "1", "--max-model-len", "512",
                                      "--max-num-seqs", "4", "--port", str(port)])
    config = ServerConfig(api_key="sesame", default_max_tokens=TOKENS)
    texts = [prompts[i].messages[0]["content"] for i in PROMPTS]

    def ask(client, text):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}],
                                                      "deterministic": True},
                        headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 200, r.text
        body = r.json()
        report = body["determinism"]
        env = report.pop("environment")
        return body["choices"][0]["message"]["content"], body["choices"][0].get("token_ids"), report, env

    engine = Engine(llm.model, EngineConfig(max_num_seqs=4, max_model_len=512), lambda: llm.policy("fast"),
                    detokenize=text_decoder(llm.tokenizer), grammars=llm.grammars)
    with TestClient(create_app(llm, config, engine=engine)) as local:
        expected = [ask(local, t) for t in texts]

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(deployment(args, config, 2, 1), name=APP_NAME, route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            assert http.get("/v1/models").status_code == 401  # the same API key guard
            with ThreadPoolExecutor(4) as ex:  # concurrent: both replicas take requests
                got = list(ex.map(lambda t: ask(http, t), texts))
            assert http.get("/metrics").status_code == 401
            # /metrics answers for the fleet: every replica's requests, as one server would count them
            assert poll(lambda: finished(http.get("/metrics", headers={"Authorization": "Bearer sesame"}).text)
                        == len(texts)), "the replicas' metrics do not add up to the requests served"
        for (text, ids, report, env), (text0, ids0, report0, env0) in zip(got, expected):
            assert (text, ids, report) == (text0, ids0, report0)
            assert env["num_threads"] == 1
            assert {**contract_part(env), "num_threads": 0} == {**contract_part(env0), "num_threads": 0}
    finally:
        serve.shutdown()
