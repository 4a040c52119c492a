"""Preemption on the embedded model, on the paths a pool that runs out reaches: every deterministic policy x {the
prefix cache, speculation, int8 and int4 K/V (with prefix sharing and a fork), n > 1 forks}, each request's tokens AND
logprobs bitwise those of the request alone; the verifying policies with a forced flip (`inject_flip_at`) that
they must roll back while being preempted. Then the scheduler's own behaviour: the reserve at admission, no
admission right after a preemption, the victim, no thrashing in a tight pool, the reuse of a victim's blocks
through the prefix cache, and a run at max_num_seqs 64.

Preemptions are forced at fixed steps (`drive`) in a pool that only holds two requests at once, so that every
case preempts mid-prefill and mid-decode whatever the scheduler's reserve would have avoided. The default tier
runs each policy once and each feature at least once; the slow tier the rest of the cross product.
"""
from __future__ import annotations

import pytest
from prompt_sets import HET8

from margingate.data.prompts import Prompt
from margingate.engine import Request
from margingate.engine import scheduler as scheduling
from margingate.engine.engine import Engine, EngineConfig
from margingate.engine.pool import bytes_per_position
from margingate.options import PolicySpec, SamplingParams, SpeculativeConfig
from margingate.policies import build

NEW = 20  # past one dvr window (16)
POLICIES = ["batch-invariant", "reference", "margin", "verify-all", "dvr"]
VERIFYING = {"margin", "verify-all", "dvr"}
# the strict replay finds a forced flip and rolls back (margin, dvr); verify-all repairs by column, every step
# verified: it never emits an unverified token, and has no replay that would look back at a forced one
FLIPPED = {"margin", "dvr"}
FLIP_AT = 3          # output index of the forced wrong token (verifying policies)
PREEMPT_AT = (2, 7, 13)  # engine steps before which the scheduler's victim is preempted
COPY = "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
NGRAM = SpeculativeConfig("ngram", num_tokens=4)
LOGPROBS = SamplingParams(logprobs=2)
FEATURES = ["prefix", "speculation", "int8", "int4", "n>1"]
# the default tier: each policy once, each feature at least once
# (the cheapest pairing of each, measured: dvr's windows replay after the flip, so its plain preempted run, with
# speculation asked and turned off, costs least)
DEFAULT_TIER = {("batch-invariant", "speculation"), ("reference", "int8"), ("margin", "n>1"), ("verify-all", "prefix"),
                ("dvr", "speculation")}


@pytest.fixture(scope="module")
def ids(llm, prompts):
    """2 built-in prompts and one that repeats itself (the ngram proposer finds matches)."""
    copy = llm.tokenizer.encode_prompt(Prompt("chat", ({"role": "user", "content": COPY},), None, "copy"))
    return [llm.tokenizer.encode_prompt(prompts[i]) for i in HET8[:2]] + [copy]


def engine(llm, policy: str, blocks: int | None = None, **config) -> Engine:
    """An engine over the session's model; `blocks`: a pool of exactly that many blocks of 16 positions."""
    if blocks is not None:
        dtype = config.get("kv_cache_dtype", "bfloat16")
        config["kv_cache_memory"] = blocks * 16 * bytes_per_position(llm.model.config, dtype) / 1e9
    return Engine(llm.model, EngineConfig(num_threads=llm.engine.num_threads, max_model_len=512, **config),
                  lambda: build(PolicySpec(policy)))


def policy(name: str, flip: bool = False):
    return build(PolicySpec(name, inject_flip_at=FLIP_AT if flip and name in FLIPPED else None))


def drive(eng: Engine, reqs: list[Request], preempt_at=PREEMPT_AT) -> list:
    """Run `reqs` to the end, preempting the scheduler's victim before each step in `preempt_at`; the
    (tokens, logprobs, stats) of each."""
    seqs, step = [eng.add_request(r) for r in reqs], 0
    while eng.has_work:
        if step in preempt_at and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.victim())
        eng.step()
        step += 1
    return [(r.token_ids, r.logprobs, r.stats) for r in map(eng.result, seqs)]


class Alone:
    """Each prompt decoded alone (no flip, no preemption, nothing beside it) under a policy and a K/V dtype."""

    def __init__(self, llm):
        self.llm, self.done = llm, {}

    def get(self, name: str, prompt: list[int], kv: str = "bfloat16") -> tuple:
        key = (name, kv, tuple(prompt))
        if key not in self.done:
            eng = engine(self.llm, name, max_num_seqs=1, kv_cache_dtype=kv)
            out = eng.generate([Request(prompt, NEW, policy(name), ignore_eos=True, sampling=LOGPROBS)])[0]
            self.done[key] = (out.token_ids, out.logprobs)
        return self.done[key]


@pytest.fixture(scope="module")
def alone(llm):
    return Alone(llm)


def requests(ids, name: str, tag: str, feature: str) -> list[Request]:
    """The case's requests: each prompt once (speculating, for `speculation`), and for `n>1` and K/V formats a second
    sample of the first prompts sharing its sibling's prompt blocks."""
    spec = NGRAM if feature == "speculation" else None
    reqs = [Request(x, NEW, policy(name, flip=True), ignore_eos=True, request_id=f"{tag}{i}", sampling=LOGPROBS,
                    speculative=spec) for i, x in enumerate(ids)]
    forks = {"n>1": 2, "int8": 1, "int4": 1}.get(feature, 0)
    return reqs + [Request(ids[i], NEW, policy(name, flip=True), ignore_eos=True, request_id=f"{tag}{i}b",
                           sampling=LOGPROBS, share_prefill=f"{tag}{i}") for i in range(forks)]


def config_for(feature: str) -> dict:
    return {"prefix": {"prefix_cache_tokens": 4096},
            "speculation": {"speculative_cost_model": False},  # every proposal fed: drafts pend when blocks run out
            "int8": {"kv_cache_dtype": "int8", "prefix_cache_tokens": 4096},
            "int4": {"kv_cache_dtype": "int4", "prefix_cache_tokens": 4096},
            "n>1": {}}[feature]


def cases() -> list:
    return [pytest.param(p, f, marks=() if (p, f) in DEFAULT_TIER else pytest.mark.slow)
            for p in POLICIES for f in FEATURES]


@pytest.mark.parametrize("name, feature", cases())
def test_preempted_requests_keep_the_bits_of_the_request_alone(llm, ids, alone, name, feature):
    """In a pool that holds two requests, with three forced preemptions (mid-prefill and mid-decode) and, for the
    strict replay's policies (margin, dvr), a wrong token forced at output 3: every request's tokens and logprobs
    equal, bitwise, its prompt decoded alone under the same policy (without the flip). A prefix-cache case runs
    its requests twice (cold, then hitting the blocks the first run and the victims left)."""
    config = config_for(feature)
    kv = config.get("kv_cache_dtype", "bfloat16")
    need = max(-(-(len(x) + NEW) // 16) for x in ids)
    eng = engine(llm, name, blocks=2 * need + 1, max_num_seqs=4, prefill_chunk=32, **config)
    rounds = 2 if "prefix_cache_tokens" in config else 1
    got = [r for k in range(rounds) for r in drive(eng, requests(ids, name, f"r{k}", feature))]
    assert eng.load.preemptions >= len(PREEMPT_AT) and eng.load.blocks_used == 0
    prompts = [r.prompt_ids for k in range(rounds) for r in requests(ids, name, f"r{k}", feature)]
    for i, ((tokens, logprobs, stats), prompt) in enumerate(zip(got, prompts)):
        assert (tokens, logprobs) == alone.get(name, prompt, kv), f"{name}, {feature}: request {i}"
        if name in FLIPPED:  # the flip was emitted, found and rolled back
            assert stats["injected"] == 1 and stats["rollbacks"] >= 1, (i, stats)
    if feature == "speculation" and name in ("batch-invariant", "reference"):
        assert sum(s.get("accepted_tokens", 0) for _, _, s in got) > 0, "no proposal was accepted"


# --- the scheduler -----------------------------------------------------------------------------------------

def test_admission_keeps_room_for_the_running_requests_growth(llm, ids, alone):
    """A pool with room for two requests' whole length but for three prompts: the third waits until one
    finishes instead of being admitted into a shortage, so nothing is preempted, and all equal alone."""
    need = -(-(max(map(len, ids)) + NEW) // 16)
    eng = engine(llm, "batch-invariant", blocks=2 * need + 2, max_num_seqs=4)
    seqs = [eng.add_request(Request(x, NEW, ignore_eos=True, request_id=f"a{i}", sampling=LOGPROBS))
            for i, x in enumerate(ids[:3])]
    eng.step()
    assert len(eng.scheduler.running) == 2 and eng.scheduler.waiting[0] is seqs[2]
    while eng.has_work:
        eng.step()
    assert eng.load.preemptions == 0
    for s, x in zip(seqs, ids):
        r = eng.result(s)
        assert (r.token_ids, r.logprobs) == alone.get("batch-invariant", x)


def test_no_admission_right_after_a_preemption_and_the_victim_is_the_least_progress(llm, ids):
    """The victim is the running request with the fewest output tokens (the newest among equals); the step after
    its preemption admits nobody, though it would fit; the one after readmits it first."""
    eng = engine(llm, "batch-invariant", max_num_seqs=4)
    old = eng.add_request(Request(ids[0], NEW, ignore_eos=True, request_id="old"))
    eng.step()
    eng.step()
    a = eng.add_request(Request(ids[1], NEW, ignore_eos=True, request_id="a"))
    b = eng.add_request(Request(ids[2], NEW, ignore_eos=True, request_id="b"))
    eng.step()  # a and b prefilled: one output token each, `old` three
    assert len(old.output_ids) > len(a.output_ids) == len(b.output_ids)
    assert eng.scheduler.victim() is b
    eng.scheduler.preempt(b)
    late = eng.add_request(Request(ids[0], NEW, ignore_eos=True, request_id="late"))
    assert eng.scheduler.admit() == []
    assert eng.scheduler.admit() == [b, late] and b.recompute


@pytest.mark.slow
def test_a_tight_pool_preempts_rarely_and_recovers(llm, ids, monkeypatch):
    """Six speculating requests in a pool that holds about three, the reserve switched off at the start (admission
    as greedy as before it existed): the pool runs out while proposals are pending, the reserve comes back at full
    ratio, no request is preempted twice (no recompute loop), and the run ends with fewer preemptions than
    requests; each request's tokens and logprobs equal those of the same requests, without proposals, in a pool
    with room for all."""
    monkeypatch.setattr(scheduling, "RATIO_MIN", 0.0)
    long = [x * (100 // len(x) + 1) for x in ids[:2]]  # ~100-token prompts that repeat: the ngram proposer matches
    prompts = [long[i % 2][:90 + 3 * i] for i in range(6)]

    def reqs(tag: str, spec=None) -> list[Request]:
        return [Request(x, NEW, ignore_eos=True, request_id=f"{tag}{i}", sampling=LOGPROBS, speculative=spec)
                for i, x in enumerate(prompts)]
    roomy = engine(llm, "batch-invariant", max_num_seqs=6).generate(reqs("r"))
    need = -(-(max(map(len, prompts)) + NEW) // 16)
    eng = engine(llm, "batch-invariant", blocks=3 * need, max_num_seqs=6, speculative_cost_model=False)
    eng.scheduler.growth_ratio, eng.scheduler.watermark = 0.0, 0
    pending, victims, preempt = [], [], eng.scheduler.preempt

    def spy(seq):  # were proposals waiting for blocks when the pool ran out?
        pending.append(any(s.drafts for s in eng.scheduler.running))
        victims.append(seq.request_id)
        preempt(seq)
    eng.scheduler.preempt = spy
    out = eng.generate(reqs("t", NGRAM))
    assert 1 <= len(pending) < len(prompts) and any(pending)
    assert len(set(victims)) == len(victims), f"a request was preempted again after its readmission: {victims}"
    assert sum(r.stats["accepted_tokens"] for r in out) > 0
    assert [(r.token_ids, r.logprobs) for r in out] == [(r.token_ids, r.logprobs) for r in roomy]


@pytest.mark.parametrize("name", ["batch-invariant", "margin"])
def test_a_victim_maps_its_kept_blocks_back_through_the_prefix_cache(llm, ids, alone, name):
    """Preempted after 14 tokens with the prefix cache on, a request leaves its whole blocks in the cache and maps
    them back on readmission: batch-invariant, whose decode rows write the prompt path's bits, keeps its output's
    blocks too and recomputes under one block; margin keeps its prompt's only. Both decode on to the bits alone."""
    eng = engine(llm, name, max_num_seqs=2, prefix_cache_tokens=4096)
    seq = eng.add_request(Request(ids[2], NEW, ignore_eos=True, request_id="v", sampling=LOGPROBS))
    while len(seq.output_ids) < 14:
        eng.step()
    kept = seq.last_fed_pos // 16 * 16 if name == "batch-invariant" else len(ids[2]) // 16 * 16
    eng.scheduler.preempt(seq)
    eng.step()  # admits nobody: right after a preemption
    reused = eng.prefix.stats.reused_tokens
    eng.step()  # readmitted: maps what the cache kept, recomputes the rest
    assert eng.prefix.stats.reused_tokens - reused == kept and seq.cached_tokens == 0 and not seq.recompute
    while eng.has_work:
        eng.step()
    r = eng.result(seq)
    assert (r.token_ids, r.logprobs) == alone.get(name, ids[2])


@pytest.mark.slow
def test_sixty_four_requests_run_at_once(llm, ids, alone):
    """max_num_seqs 64 (the default): 64 requests (the three prompts in turn, batch-invariant and margin
    in turn) run in the same steps, 64 decode rows a step, and each equals its prompt alone."""
    eng = engine(llm, "batch-invariant", max_num_seqs=64)
    names = ["batch-invariant", "margin"]
    reqs = [Request(ids[i % 3], 4, policy(names[i % 2]), ignore_eos=True, request_id=f"q{i}", sampling=LOGPROBS)
            for i in range(64)]
    seqs = [eng.add_request(r) for r in reqs]
    most = 0
    while eng.has_work:
        eng.step()
        most = max(most, len(eng.scheduler.running))
    assert most == 64 and eng.load.preemptions == 0
    for i, s in enumerate(seqs):
        r, (tokens, logprobs) = eng.result(s), alone.get(names[i % 2], ids[i % 3])
        assert (r.token_ids, r.logprobs) == (tokens[:4], logprobs[:4]), f"request {i}"
