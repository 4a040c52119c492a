"""The prefix cache's mechanics: what a hit reuses (the prompt's whole blocks, never decode-written K/V),
and a bounded cache that evicts the least recently used blocks, leaves before the prefixes they hang from.
That a hit keeps the promise (bitwise the tokens of the request alone, for every deterministic policy) is
the contract's: determinism/test_contract.py."""
from __future__ import annotations

import pytest

from margingate.data.prompts import Prompt
from margingate.engine import Request
from margingate.engine.engine import Engine, EngineConfig
from margingate.engine.prefix_cache import PrefixCache
from margingate.models.kv_cache import BlockTable, KVPool, PoolExhausted

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
    engine = Engine(llm.model, EngineConfig(max_num_seqs=8, max_model_len=512, prefix_cache_tokens=2048),
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


def test_bounded_lru_evicts_leaves_first():
    """At most max_tokens positions; a hit maps the cached blocks into the table (shared, counted, not copied)
    and refreshes its chain; the oldest block goes first, and a chain's blocks are touched from the last to the
    first, so a shared prefix outlives the suffixes below it."""
    pool = KVPool(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=8)
    cache = PrefixCache(pool, max_tokens=3 * 4)
    a, b = list(range(9)), [*range(4), 50, 51, 52, 53, 54]  # share their first block

    def written(prompt):  # a table holding the prompt's K/V, as after its prefill
        table = BlockTable.empty(pool)
        table.prepare(0, len(prompt))
        return table

    ta = written(a)
    cache.store(a, ta)                                   # blocks a0 a1
    hit = BlockTable.empty(pool)
    assert cache.load(a, hit) == 8 and hit.blocks == ta.blocks[:2]  # the last position is always left to compute
    assert [pool.refs[x] for x in hit.blocks] == [3, 3]  # a's table, the cache, the hit
    cache.store(b, written(b))                           # b1 (b0 is a0): 3 blocks, full
    assert cache.cached_tokens == 12 and cache.stats.evicted_blocks == 0
    cache.store([7] * 5, written([7] * 5))               # one more: evicts a1, the oldest leaf; the shared a0 stays
    assert cache.cached_tokens == 12 and cache.stats.evicted_blocks == 1
    assert pool.refs[ta.blocks[1]] == 2                  # still held by a's table and the hit
    assert cache.load(a, BlockTable.empty(pool)) == 4 and cache.load(b, BlockTable.empty(pool)) == 8
    assert cache.load([9] * 9, BlockTable.empty(pool)) == 0
    assert (cache.stats.hits, cache.stats.misses, cache.stats.reused_tokens) == (3, 1, 20)
    with pytest.raises(ValueError, match="max_tokens >= the block size 4"):
        PrefixCache(pool, max_tokens=3)


def test_a_full_pool_frees_cached_blocks_nobody_holds():
    """When the pool runs out, the least recently used cached block that no request holds goes back to it;
    blocks a request still holds are never taken."""
    pool = KVPool(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8)
    cache = PrefixCache(pool, max_tokens=64)
    held, dropped = BlockTable.empty(pool), BlockTable.empty(pool)
    held.prepare(0, 5)
    dropped.prepare(0, 4)
    cache.store(list(range(5)), held)
    cache.store([9] * 4, dropped)
    dropped.free()                                       # only the cache holds its block now
    assert pool.num_free == 1 and cache.evictable == 1
    fresh = BlockTable.empty(pool)
    fresh.prepare(0, 8)                                  # two blocks: the free one, then the cached one
    assert cache.cached_tokens == 4 and cache.stats.evicted_blocks == 1
    with pytest.raises(PoolExhausted):
        fresh.prepare(8, 9)                              # the rest are held by requests
