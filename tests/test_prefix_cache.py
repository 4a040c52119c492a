"""The prefix cache's mechanics: what a hit reuses (the prompt's whole blocks, never decode-written K/V),
and a bounded cache that evicts the least recently used blocks, leaves before the prefixes they hang from.
That a hit keeps the promise (bitwise the tokens of the request alone, for every deterministic policy) is
the contract's: determinism/test_contract.py."""
from __future__ import annotations

import pytest
import torch

from margingate.data.prompts import Prompt
from margingate.engine import Request
from margingate.engine.engine import Engine, EngineConfig
from margingate.engine.prefix_cache import PrefixCache
from margingate.models.kv_cache import KVCache

SYSTEM = ("You are a patient tutor. Answer in short sentences, show each step of the reasoning, "
          "and finish with a one-line summary that starts with 'So'.")
QUESTIONS = ["What is 17 times 3?", "Why do leaves change color?", "Name two prime numbers above 50."]
NEW = 16


def chat_ids(llm, *turns: tuple[str, str]) -> list[int]:
    messages = ({"role": "system", "content": SYSTEM}, *({"role": r, "content": c} for r, c in turns))
    return llm.tokenizer.encode_prompt(Prompt("chat", messages, None, "test"))


@pytest.fixture(scope="module")
def prompts(llm):
    """Three questions under one system prompt, and a second turn of the first conversation (its prompt
    holds the first turn's prompt and answer: a multi-turn hit)."""
    first = [chat_ids(llm, ("user", q)) for q in QUESTIONS]
    answer = llm.engine.generate([Request(first[0], NEW, llm.policy("reference"), ignore_eos=True)])[0]
    second = chat_ids(llm, ("user", QUESTIONS[0]), ("assistant", llm.tokenizer.decode(answer.token_ids)),
                      ("user", "Now divide that by 3."))
    return [*first, second]


def test_hits_reuse_prompt_blocks_not_answers(llm, prompts):
    """Round 1 is cold (an empty cache: every admission misses); round 2 sends the same prompts again: each
    hits all its whole blocks but the one holding its last position, and the second turn hits the first
    turn's prompt, not its answer (decode-written K/V is never stored)."""
    engine = Engine(llm.model, EngineConfig(max_batch_size=8, max_model_len=512, prefix_cache_tokens=2048),
                    lambda: llm.policy("fast"))

    def round_(tag: str, prompts: list[list[int]]):
        return engine.generate([Request(p, NEW, llm.policy("reference"), ignore_eos=True, request_id=f"{tag}{i}")
                                for i, p in enumerate(prompts)])

    cold = round_("cold", prompts[:3])
    assert all(r.cached_tokens == 0 for r in cold)
    hit = round_("hit", prompts)
    block = engine.prefix.block
    assert [r.cached_tokens for r in hit[:3]] == [(len(p) - 1) // block * block for p in prompts[:3]]
    assert hit[3].cached_tokens == len(prompts[0]) // block * block


def test_bounded_lru_evicts_leaves_first(llm):
    """At most max_tokens positions; a hit refreshes its chain; the oldest block goes first, and a chain's
    blocks are touched from the last to the first, so a shared prefix outlives the suffixes below it."""
    mc = llm.model.config
    kv = KVCache(mc.num_layers, 2, 64, mc.num_kv_heads, mc.head_dim, torch.bfloat16, "cpu")
    kv.k.normal_()
    kv.v.normal_()
    cache = PrefixCache(max_tokens=3 * 4, block=4)
    a, b = list(range(9)), [*range(4), 50, 51, 52, 53, 54]  # share their first block
    cache.store(a, kv, slot=0)                 # blocks a0 a1
    assert cache.load(a, kv, slot=1) == 8      # the last position is always left to compute
    assert torch.equal(kv.k[:, 1, :, :8], kv.k[:, 0, :, :8]) and torch.equal(kv.v[:, 1, :, :8], kv.v[:, 0, :, :8])
    cache.store(b, kv, slot=0)                 # b1 (b0 is a0): 3 blocks, full
    assert cache.cached_tokens == 12 and cache.stats.evicted_blocks == 0
    cache.store([7] * 5, kv, slot=0)           # one more: evicts a1, the oldest leaf; the shared a0 stays
    assert cache.cached_tokens == 12 and cache.stats.evicted_blocks == 1
    assert cache.load(a, kv, slot=1) == 4 and cache.load(b, kv, slot=1) == 8
    assert cache.load([9] * 9, kv, slot=1) == 0
    assert (cache.stats.hits, cache.stats.misses, cache.stats.reused_tokens) == (3, 1, 20)
    with pytest.raises(ValueError, match="max_tokens >= block"):
        PrefixCache(max_tokens=3, block=4)
