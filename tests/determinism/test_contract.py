"""The determinism contract, in one parametrized test: under every deterministic policy, each request gets
bitwise the tokens of its prompt decoded alone (a batch of one) by `reference`, whatever else shares its
batch. The cases are the axes the promise spans, one at a time: batch mode and size (8 different prompts,
one prompt 4 times), threads (1 against the session's default, all cores), prefill (whole; chunked, so
prompt chunks share steps with decode rows), the prefix cache (a hit against a cold run) and staggered
arrivals (requests joining a running batch, beside `fast` ones). `reference` in a batch is one of them.
`make test` runs every policy on hetero-8 and every case under one policy (DEFAULT_TIER); `make test-all` every pair.

The policies come from `deterministic_policies()`, so a new one is held to the contract as soon as it
says it promises it. Below the contract, the inverse controls: runs that must break it, so that the
assertion is shown able to fail. The reference alone is decoded once per prompt and shared by every case.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from prompt_sets import HET8

from determinism.contract import Alone, assert_same_tokens
from margingate.engine import Request
from margingate.engine.engine import Engine, EngineConfig
from margingate.kernels import layers, library
from margingate.options import AUTO, deterministic_policies

NEW = 20  # tokens per request: past one dvr window (16), and long enough for the controls' flips
POLICIES = [name for name in deterministic_policies() if name != AUTO]  # `auto` names one of these per device


@pytest.fixture(scope="module")
def ids(llm, prompts):
    """HET8: math, code, chat and instruction prompts, 23 to 80 tokens."""
    return [llm.tokenizer.encode_prompt(prompts[i]) for i in HET8]


@pytest.fixture(scope="module")
def alone(llm):
    return Alone(llm, NEW)


def requests(llm, prompts, policy: str, tag: str, n: int = NEW, arrivals=None) -> list[Request]:
    arrivals = arrivals or [0] * len(prompts)
    return [Request(x, n, llm.policy(policy), ignore_eos=True, request_id=f"{tag}{i}", arrival_step=a)
            for i, (x, a) in enumerate(zip(prompts, arrivals))]


def fast_neighbours(llm, prompts, tag: str, arrivals=None) -> list[Request]:
    """`fast` requests to share the batch: the prompts reversed, each a different length."""
    arrivals = arrivals or [0] * len(prompts)
    return [Request(x[::-1], NEW + 3 + 5 * i, llm.policy("fast"), ignore_eos=True, request_id=f"{tag}{i}",
                    arrival_step=a) for i, (x, a) in enumerate(zip(prompts, arrivals))]


def engine(llm, **config) -> Engine:
    """A fresh engine over the session's model (its own KV slots), at the session's threads unless told."""
    config.setdefault("num_threads", llm.engine.num_threads)
    return Engine(llm.model, EngineConfig(max_model_len=256, **config), lambda: llm.policy("fast"))


# --- the cases: each decodes under `policy` and returns the requests the contract holds it to ---------------

def hetero_8(llm, ids, policy):
    """8 different prompts in one batch; a verifying policy got there by verifying (its gate fired)."""
    out = llm.engine.generate(requests(llm, ids, policy, "h"))
    if llm.policy(policy).verifies:
        assert sum(r.stats["triggers"] for r in out) > 0, f"{policy}: the gate never fired"
    return out


def homo_4(llm, ids, policy):
    """One prompt 4 times in one batch (another batch size, every row alike)."""
    return llm.engine.generate(requests(llm, [ids[7]] * 4, policy, "m"))


def one_thread(llm, ids, policy):
    """4 prompts on an engine at 1 torch thread (the session's engine and the reference run at all cores)."""
    return engine(llm, max_num_seqs=4, num_threads=1).generate(requests(llm, ids[:4], policy, "t"))


def chunked_prefill(llm, ids, policy):
    """4 prompts (23 to 80 tokens) prefilled 7 positions per step: the short ones decode beside the long
    ones' chunks."""
    return engine(llm, max_num_seqs=4, prefill_chunk=7).generate(requests(llm, ids[4:], policy, "c"))


def prefix_hit(llm, ids, policy):
    """A prefix cache: 3 prompts sent cold (every admission misses), then again (they hit), each time beside
    a `fast` request."""
    e = engine(llm, max_num_seqs=4, prefix_cache_tokens=2048)
    cold = e.generate([*requests(llm, ids[:3], policy, "cold"), *fast_neighbours(llm, ids[3:4], "cf")])[:3]
    hit = e.generate([*requests(llm, ids[:3], policy, "hit"), *fast_neighbours(llm, ids[3:4], "hf")])[:3]
    assert [r.cached_tokens for r in cold] == [0] * 3 and all(r.cached_tokens > 0 for r in hit), "no hit"
    return [*cold, *hit]


def staggered(llm, ids, policy):
    """4 requests arriving at engine steps 0, 2, 5 and 9, beside `fast` ones arriving at 0 and 4: each joins
    a batch mid-prefill or mid-decode, and the batch changes size as requests come and go."""
    reqs = requests(llm, ids[2:6], policy, "s", arrivals=[0, 2, 5, 9])
    return llm.engine.generate([*reqs, *fast_neighbours(llm, ids[6:8], "sf", arrivals=[0, 4])])[:4]


CASES = {"hetero-8": hetero_8, "homo-4": homo_4, "1-thread": one_thread, "chunked-prefill": chunked_prefill,
         "prefix-hit": prefix_hit, "staggered": staggered}


# The default tier (`make test`) runs every policy on hetero-8 and each other case once, under the policy named
# here (each policy once, the cheaper pairings); the slow tier (`make test-all`) runs every other pair.
DEFAULT_TIER = {"homo-4": "reference", "1-thread": "margin", "chunked-prefill": "dvr", "prefix-hit": "batch-invariant",
                "staggered": "verify-all"}


def policy_case_pairs() -> list:
    return [pytest.param(policy, case, marks=() if case == "hetero-8" or DEFAULT_TIER[case] == policy
                         else pytest.mark.slow) for case in CASES for policy in POLICIES]


@pytest.mark.parametrize("policy, case", policy_case_pairs())
def test_same_tokens_as_the_reference_alone(llm, ids, alone, policy, case):
    """The contract: each request of the case, under `policy`, equals its prompt decoded alone by `reference`."""
    threads = torch.get_num_threads()
    try:
        out = CASES[case](llm, ids, policy)
    finally:
        torch.set_num_threads(threads)  # an engine at other threads set the process's
    assert_same_tokens(out, alone.of(out, NEW), f"{policy}, {case}")


# --- inverse controls: the contract's assertion can fail ------------------------------------------------------

def test_control_fast_flips_in_a_batch(llm, ids):
    """Inverse control: `fast` (no promise) over the 8 different prompts breaks the same assertion, held to
    its own requests alone: the batch moves some of its tokens."""
    out = llm.engine.generate(requests(llm, ids, "fast", "f"))
    with pytest.raises(AssertionError, match="differ from the request alone"):
        assert_same_tokens(out, Alone(llm, NEW, "fast").of(out, NEW), "fast, hetero-8")


@pytest.mark.slow  # fp32 layer by layer, each prompt alone too: the contract module's longest run
def test_control_a_library_kernel_is_caught(llm, ids, monkeypatch):
    """Inverse control: torch's fp32 GEMM (MKL / oneDNN, which pick their algorithm by the number of rows)
    swapped into the invariant kernel set, which every deterministic policy runs: `batch-invariant` over the
    8 different prompts no longer equals the request alone (decoded under the same swap), and the assertion
    raises. fp32, not bf16: on some CPUs (an AVX2-only Zen 3 here) the library's bf16 GEMM happens to keep
    its rows at these shapes, and its fp32 GEMM does not (M = 1, 2-4 and 5+ differ)."""
    plain = {}

    def library_linear(x, w, b=None):
        if id(w) not in plain:
            plain[id(w)] = w.unpack().float()
        return library.linear(x.float(), plain[id(w)], None if b is None else b.float()).to(x.dtype)

    monkeypatch.setattr(layers, "INVARIANT", dataclasses.replace(layers.INVARIANT, linear=library_linear))
    monkeypatch.setattr(llm.model, "fused", False)  # the compiled whole-stack call would bypass the kernel set
    out = llm.engine.generate(requests(llm, ids, "batch-invariant", "l"))
    with pytest.raises(AssertionError, match="differ from the request alone"):
        assert_same_tokens(out, Alone(llm, NEW).of(out, NEW), "batch-invariant, library GEMM, hetero-8")
