"""The engine end to end on the embedded model: run-to-run determinism, continuous
batching, and fast and protected requests sharing a batch. That a deterministic request equals
the request alone in any batch is the contract's (determinism/test_contract.py), with its
inverse controls."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prompt_sets import EOS_STOPPERS, HET8, HET16

from margingate.engine import Request
from margingate.engine.engine import Engine, EngineConfig
from margingate.environment import START_FIELDS, contract_part
from margingate.options import PolicySpec
from margingate.policies import build

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ids(llm, prompts):
    """Token ids of every built-in prompt, by index."""
    return [llm.tokenizer.encode_prompt(p) for p in prompts]


@pytest.fixture(scope="module")
def ref(references):
    """The reference output (64 tokens, or up to EOS) of each HET16 prompt, by prompt index."""
    return dict(zip(HET16, references.get(HET16, 64)))


def small_engine(llm, policy: str = "reference", **config) -> Engine:
    """A second engine over the already loaded model (its own KV slots)."""
    config.setdefault("max_num_seqs", 2)
    return Engine(llm.model, EngineConfig(num_threads=llm.engine.num_threads, **config),
                  lambda: build(PolicySpec(policy)))


def drain(engine: Engine) -> list:
    finished = []
    while engine.has_work:
        finished += engine.step()
    return finished


# --- continuous batching -------------------------------------------------------------


def test_queueing_beyond_the_slots(llm, ids, ref):
    """5 requests on 2 slots: 2 run while 3 queue; all finish, first come first served,
    every slot is freed, and (policy reference) each equals its reference."""
    engine = small_engine(llm)
    reqs = [Request(ids[i], max_new_tokens=12, request_id=f"r{i}") for i in HET8[:5]]
    seqs = [engine.add_request(r) for r in reqs]
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 3
    finished = [s.request_id for s in drain(engine)]
    assert finished == [r.request_id for r in reqs]  # FIFO admission, equal lengths
    assert engine.load.blocks_used == 0
    for i, s in zip(HET8, seqs):
        assert engine.result(s).token_ids == ref[i].token_ids[:12]
        assert engine.result(s).finish_reason == "length"


def test_generate_results_in_request_order_with_staggered_arrivals(llm, ids, ref):
    """Staggered `arrival_step`s and unequal lengths on 2 slots: `generate` returns results
    in request order, each (policy reference) equal to its reference."""
    engine = small_engine(llm)
    plan = [(0, 16), (3, 6), (3, 12), (8, 16), (20, 4)]  # (arrival step, max_new_tokens)
    reqs = [Request(ids[i], max_new_tokens=n, arrival_step=a, request_id=f"s{i}")
            for i, (a, n) in zip(HET8, plan)]
    results = engine.generate(reqs)
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    for i, r, (_, n) in zip(HET8, results, plan):
        assert r.token_ids == ref[i].token_ids[:n] and r.finish_reason == "length"


def test_staggered_fast_replays_exactly(llm, ids):
    """The fast path is not batch-invariant, but a replayed workload (same arrivals, same
    slots) gives the same tokens: arrivals are counted in engine steps."""
    plan = [(0, 10), (2, 10), (2, 6), (5, 10)]
    runs = []
    for _ in range(2):
        reqs = [Request(ids[i], max_new_tokens=n, arrival_step=a, request_id=f"f{i}")
                for i, (a, n) in zip(HET8, plan)]
        runs.append([r.token_ids for r in small_engine(llm, "fast", max_num_seqs=3).generate(reqs)])
    assert runs[0] == runs[1]


def test_abort_running_and_waiting(llm, ids):
    """`abort` drops a running request (freeing its slot at once) or a waiting one;
    an unknown id is reported; aborted requests come back from the next step as
    finished ("aborted"), so a driver never waits on them; the rest run to completion."""
    engine = small_engine(llm, "fast")
    seqs = [engine.add_request(Request(ids[i], max_new_tokens=8, request_id=f"a{k}"))
            for k, i in enumerate(HET8[:3])]
    engine.step()
    held = engine.load.blocks_used
    assert held == sum(len(s.cache.blocks) for s in seqs[:2]) and seqs[2].cache is None
    assert engine.abort("a1") and engine.load.blocks_used == len(seqs[0].cache.blocks) < held
    assert engine.abort("a2")  # still waiting
    assert not engine.abort("a1") and not engine.abort("nope")
    assert engine.result(seqs[1]).finish_reason == "aborted"
    finished = drain(engine)
    assert [s.request_id for s in finished] == ["a1", "a2", "a0"]
    assert [s.finish_reason for s in finished[:2]] == ["aborted", "aborted"]
    assert len(seqs[0].output_ids) == 8 and seqs[2].output_ids == []
    assert engine.load.blocks_used == 0


def test_context_limit(llm, ids, ref):
    """max_model_len=64: a prompt that fills the context (no room for a token) is refused with a
    message naming the context; one that leaves a single position gets exactly one token;
    a short one runs until the context is full ("context"), still on its reference."""
    engine = small_engine(llm, "reference", max_model_len=64)
    prompt = ids[1][:64]
    assert len(ids[1]) > 64
    for too_long in (prompt, ids[1]):
        with pytest.raises(ValueError, match="context"):
            engine.add_request(Request(too_long, max_new_tokens=4))
    [r] = engine.generate([Request(prompt[:63], max_new_tokens=4)])
    assert len(r.token_ids) == 1 and r.finish_reason == "context"
    [c] = engine.generate([Request(ids[20], max_new_tokens=64)])
    room = 64 - len(ids[20])
    assert c.finish_reason == "context" and c.token_ids == ref[20].token_ids[:room] and len(c.token_ids) == room


def test_one_new_token(llm, ids, ref):
    """max_new_tokens=1 works under every policy: the prefill's argmax, "length"."""
    reqs = [Request(ids[0], max_new_tokens=1, policy=build(PolicySpec(p)), request_id=p)
            for p in ("fast", "reference", "margin", "verify-all")]
    for r in llm.engine.generate(reqs):
        assert r.token_ids == ref[0].token_ids[:1] and r.finish_reason == "length", r.request_id


def test_eos_and_stop_tokens(llm, ids, ref):
    """Requests stop at the model's EOS (the last token, nowhere earlier); `ignore_eos`
    decodes past it; custom `stop_token_ids` stop at their first occurrence."""
    eos = set(llm.config.eos_token_ids)
    for i in EOS_STOPPERS:
        toks = ref[i].token_ids
        assert ref[i].finish_reason == "stop" and len(toks) < 64
        assert toks[-1] in eos and not eos & set(toks[:-1])
    i = EOS_STOPPERS[-1]
    toks = ref[i].token_ids
    stop_at = toks[4]
    first = toks.index(stop_at)
    reqs = [Request(ids[i], max_new_tokens=len(toks) + 3, ignore_eos=True, request_id="ignore"),
            Request(ids[i], max_new_tokens=64, stop_token_ids=(stop_at,), request_id="custom")]
    ignore, custom = small_engine(llm).generate(reqs)
    assert ignore.finish_reason == "length" and len(ignore.token_ids) == len(toks) + 3
    assert ignore.token_ids[:len(toks)] == toks
    assert custom.finish_reason == "stop" and custom.token_ids == toks[:first + 1]


# --- policies in a heterogeneous batch -------------------------------------------------


def test_mixed_fast_and_margin_batch(llm, ids, ref):
    """Half the batch "fast", half "margin" (32 tokens): the fast requests are bitwise those of an
    all-fast run of the same batch (protection does not disturb the neighbours), and
    the margin requests equal their references."""
    fast, margin = build(PolicySpec("fast")), build(PolicySpec("margin"))
    mixed_policy = [fast if k % 2 == 0 else margin for k in range(len(HET8))]

    def run(policies):
        reqs = [Request(ids[i], max_new_tokens=32, policy=p, ignore_eos=True, request_id=f"m{i}")
                for i, p in zip(HET8, policies)]
        return llm.engine.generate(reqs)

    all_fast = run([fast] * len(HET8))
    mixed = run(mixed_policy)
    for i, p, m, f in zip(HET8, mixed_policy, mixed, all_fast):
        if p is fast:
            assert m.token_ids == f.token_ids, f"fast prompt {i} changed by its protected neighbours"
        else:
            assert m.token_ids == ref[i].token_ids[:32], f"margin prompt {i}"
    # not vacuous: the fast requests do flip in this batch
    assert any(m.token_ids != ref[i].token_ids[:32] for i, p, m in zip(HET8, mixed_policy, mixed) if p is fast)


# --- run-to-run ----------------------------------------------------------------------

SCRIPT = """
import json
from margingate.llm import LLM
from margingate.data.prompts import builtin_prompts
llm = LLM(max_num_seqs=2, num_threads=1)
out = llm.generate(builtin_prompts()[:2], max_new_tokens=16)
print(json.dumps({"tokens": [c.token_ids for c in out], "env": llm.environment()}))
"""


@pytest.fixture(scope="module", autouse=True)
def fresh_processes():
    """Two fresh processes running SCRIPT, started when this module starts so that they
    use the core the (1-thread) tests leave idle; `test_fresh_processes_agree` reads them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_fresh_processes_agree(llm, prompts, fresh_processes):
    """The same two prompts in two fresh processes (default `fast` policy, batch of 2,
    1 thread) give identical tokens, and the environment records the thread count. This process,
    at its default threads, agrees: `fast` runs our compiled kernels, which never split a
    reduction across threads, so only the batch's make-up moves its rows, and it is the same."""
    runs = []
    for proc in fresh_processes:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        runs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert all(len(t) == 16 for t in runs[0]["tokens"])
    assert contract_part(runs[0]["env"]) == contract_part(runs[1]["env"])
    assert set(START_FIELDS) <= set(runs[0]["env"])  # the start is recorded, and differs between starts
    assert runs[0]["env"]["num_threads"] == 1
    assert {"model_fingerprint", "torch", "device", "machine"} <= set(runs[0]["env"])
    here = llm.generate(prompts[:2], max_new_tokens=16, policy=llm.policy("fast"))
    assert [c.token_ids for c in here] == runs[0]["tokens"]


# --- bad inputs ------------------------------------------------------------------------


def test_bad_requests(llm, ids):
    """Empty prompts, negative or fractional max_new_tokens (0: score the prompt only) and token ids
    outside the vocabulary are refused."""
    with pytest.raises(ValueError, match="empty prompt"):
        Request([], max_new_tokens=4)
    for n in (-1, -3, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens"):
            Request(ids[0], max_new_tokens=n)
    engine = small_engine(llm, "fast")
    for bad in ([llm.config.vocab_size], [5, -1]):
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request(Request(bad, max_new_tokens=4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_generate_takes_strings_message_lists_and_prompts(llm):
    """As vLLM's `LLM.generate`: a string is raw text, a message list goes through the chat template."""
    from margingate.data.prompts import Prompt

    messages = [{"role": "user", "content": "Name a fruit."}]
    [text] = llm.generate("The capital of France is", max_new_tokens=4)
    [chat] = llm.generate(messages, max_new_tokens=4)
    both = llm.generate(["The capital of France is", messages, Prompt("text", None, "The capital of France is", "t")],
                        max_new_tokens=4)
    assert [c.token_ids for c in both] == [text.token_ids, chat.token_ids, text.token_ids]
    assert text.token_ids != chat.token_ids
    with pytest.raises(TypeError, match="prompt 0"):
        llm.generate([3], max_new_tokens=4)
