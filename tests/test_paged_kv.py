"""The paged KV cache end to end on the embedded model: a request's bits do not depend on where its blocks
lie, on sharing them (prefix cache, n samples) or on being preempted and recomputed; the pool's limits are
named at admission. The pool's own bookkeeping is tested in test_kv_and_rows.py, the kernels' reads through
shuffled block tables in test_kernels.py."""
from __future__ import annotations

import random

import pytest
from prompt_sets import HET8

from margingate.engine import Request
from margingate.engine.engine import Engine, EngineConfig
from margingate.engine.pool import bytes_per_position
from margingate.engine.sampling import SamplingParams
from margingate.options import PolicySpec
from margingate.policies import build
from margingate.scoring import score_pairs

NEW = 24


@pytest.fixture(scope="module")
def ids(llm, prompts):
    return [llm.tokenizer.encode_prompt(prompts[i]) for i in HET8[:4]]


def engine(llm, policy: str = "batch-invariant", blocks: int | None = None, **config) -> Engine:
    """An engine over the session's model; `blocks`: a pool of exactly that many blocks of 16 positions."""
    if blocks is not None:
        config["kv_cache_memory"] = blocks * 16 * bytes_per_position(llm.model.config, "bfloat16") / 1e9
    return Engine(llm.model, EngineConfig(num_threads=llm.engine.num_threads, max_model_len=512, **config),
                  lambda: build(PolicySpec(policy)))


def run(eng: Engine, ids, tag: str, policy: str | None = None, **kw) -> list:
    reqs = [Request(x, NEW, build(PolicySpec(policy)) if policy else None, ignore_eos=True, request_id=f"{tag}{i}",
                    sampling=SamplingParams(logprobs=2), **kw) for i, x in enumerate(ids)]
    return [(r.token_ids, list(r.logprobs)) for r in eng.generate(reqs)]


@pytest.fixture(scope="module")
def contiguous(llm, ids):
    """Each request alone on a fresh pool: its blocks handed out in order."""
    return [run(engine(llm), [x], "alone")[0] for x in ids]


def test_scattered_blocks_give_the_bits_of_a_contiguous_layout(llm, ids, contiguous):
    """A pool whose free blocks were shuffled hands every request scattered blocks, interleaved with the
    others': tokens and logprobs equal each request's alone on a fresh pool, bitwise."""
    eng = engine(llm, max_num_seqs=4)
    pool = eng.kv
    taken = [pool.allocate() for _ in range(pool.num_free)]
    random.Random(0).shuffle(taken)
    for block in taken:
        pool.release(block)
    seqs = [eng.add_request(Request(x, NEW, ignore_eos=True, request_id=f"s{i}",
                                    sampling=SamplingParams(logprobs=2))) for i, x in enumerate(ids)]
    eng.step()
    tables = [list(s.cache.blocks) for s in seqs]
    assert all(t != list(range(t[0], t[0] + len(t))) for t in tables)  # not contiguous
    while eng.has_work:
        eng.step()
    got = [(eng.result(s).token_ids, list(eng.result(s).logprobs)) for s in seqs]
    assert got == contiguous


def test_prefix_hits_share_blocks_and_give_the_bits_of_a_cold_run(llm, ids, contiguous):
    """A second request with a cached prompt maps the cached blocks into its table (the same block ids, each
    held by the cache and both requests), computes only the rest, and decodes the cold run's bits."""
    eng = engine(llm, max_num_seqs=4, prefix_cache_tokens=4096)
    first = eng.add_request(Request(ids[0], NEW, ignore_eos=True, request_id="cold"))
    while first.prefilling or first.cache is None:
        eng.step()
    second = eng.add_request(Request(ids[0], NEW, ignore_eos=True, request_id="hit",
                                     sampling=SamplingParams(logprobs=2)))
    eng.step()
    shared = (len(ids[0]) - 1) // 16
    assert shared >= 1 and second.cached_tokens == 16 * shared
    assert second.cache.blocks[:shared] == first.cache.blocks[:shared]
    assert all(eng.kv.refs[b] == 3 for b in second.cache.blocks[:shared])
    while eng.has_work:
        eng.step()
    result = eng.result(second)
    assert (result.token_ids, list(result.logprobs)) == contiguous[0]


def test_n_samples_share_the_prompt_blocks_and_copy_on_write(llm, ids, contiguous):
    """A fork (`share_prefill`) holds its sibling's prompt blocks (counted twice); the block both write into
    next is copied, never shared; both decode the bits of the request alone."""
    eng = engine(llm, max_num_seqs=4)
    a = eng.add_request(Request(ids[1], NEW, ignore_eos=True, request_id="a", sampling=SamplingParams(logprobs=2)))
    b = eng.add_request(Request(ids[1], NEW, ignore_eos=True, request_id="b", share_prefill="a",
                                sampling=SamplingParams(logprobs=2)))
    eng.step()  # a's prompt
    eng.step()  # b admitted on a's blocks, then its last prompt position and a's first decode row
    whole = (len(ids[1]) - 1) // 16  # blocks holding only positions both share
    assert b.cache.blocks[:whole] == a.cache.blocks[:whole]
    assert all(eng.kv.refs[x] == 2 for x in a.cache.blocks[:whole])
    last = len(ids[1]) // 16  # the block of the next writes
    assert a.cache.blocks[last] != b.cache.blocks[last] and eng.kv.refs[a.cache.blocks[last]] == 1
    while eng.has_work:
        eng.step()
    for seq in (a, b):
        r = eng.result(seq)
        assert (r.token_ids, list(r.logprobs)) == contiguous[1]


@pytest.mark.parametrize("policy", ["batch-invariant", "margin"])
def test_preemption_and_recompute_give_the_same_tokens_and_logprobs(llm, ids, contiguous, policy):
    """A pool too small for four requests at once: the reserve admits two, and a request preempted mid-decode
    (its blocks freed) recomputes its K/V through the prompt path later: every request still gets its tokens and
    logprobs alone, bitwise. (Every policy x the prefix cache, speculation, int8 and forks: test_preemption.py.)"""
    need = max(-(-(len(x) + NEW) // 16) for x in ids)
    eng = engine(llm, policy, blocks=2 * need + 1, max_num_seqs=4)
    seqs = [eng.add_request(Request(x, NEW, ignore_eos=True, request_id=f"p{i}", sampling=SamplingParams(logprobs=2)))
            for i, x in enumerate(ids)]
    for step in range(200):
        if step in (3, 9) and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.victim())
        eng.step()
        if not eng.has_work:
            break
    got = [(r.token_ids, list(r.logprobs)) for r in map(eng.result, seqs)]
    assert eng.load.preemptions == 2 and eng.load.blocks_used == 0
    if policy == "batch-invariant":
        assert got == contiguous
    else:  # margin promises the tokens; its logprobs are the fast path's where no check ran
        assert [t for t, _ in got] == [t for t, _ in contiguous]


def test_a_pool_too_small_for_a_request_is_refused_at_admission(llm, ids):
    """The context is what the pool holds: a prompt beyond it is refused when it is added, naming the pool
    and the flag that sizes it, and the engine goes on serving the others."""
    eng = engine(llm, blocks=8)
    assert eng.max_len == 7 * 16  # all but the runner's sink block
    with pytest.raises(ValueError, match=r"all the KV pool holds \(8 blocks; raise --kv-cache-memory\)"):
        eng.add_request(Request(list(range(120)), 4))
    assert run(eng, [ids[0][:20]], "ok")[0][0]


@pytest.mark.parametrize("dtype", ["int8", pytest.param("int4", marks=pytest.mark.slow)])
def test_a_quantized_cache_is_batch_invariant_and_close_to_bf16(llm, ids, contiguous, dtype):
    """int8 and int4 K/V: each request's tokens and logprobs the same alone and beside others, bitwise (each
    position rotated and quantized by itself); and, teacher-forced on the bf16 cache's greedy tokens, its top-1
    mostly those tokens (a free-running comparison would measure where the first near-tie falls instead)."""
    alone = [run(engine(llm, kv_cache_dtype=dtype), [x], "i")[0] for x in ids]
    batched = engine(llm, kv_cache_dtype=dtype, max_num_seqs=4)
    assert run(batched, ids, "j") == alone
    scores = score_pairs(batched, [(x, tokens) for x, (tokens, _) in zip(ids, contiguous)])
    agree = sum(t.top[0][0] == token for s in scores for t, token in zip(s.tokens, s.token_ids))
    assert agree >= {"int8": 0.9, "int4": 0.75}[dtype] * len(ids) * NEW


def test_a_step_budget_spreads_a_long_prompt_over_steps_beside_decoding(llm, ids, contiguous):
    """With `max_num_batched_tokens` 40, a running request decodes every step while a longer prompt is prefilled
    over several steps in the rows left: each request keeps the bits it has alone."""
    eng = engine(llm, max_num_seqs=2, max_num_batched_tokens=40)
    first = eng.add_request(Request(ids[0], NEW, ignore_eos=True, request_id="d", sampling=SamplingParams(logprobs=2)))
    while not first.output_ids:
        eng.step()
    second = eng.add_request(Request(ids[2], NEW, ignore_eos=True, request_id="p", sampling=SamplingParams(logprobs=2)))
    steps = 0
    while second.prefilling or second.cache is None:
        decoded = len(first.output_ids)
        eng.step()
        steps += 1
        assert len(first.output_ids) == decoded + 1 and second.prefilled <= 39 * steps
    assert steps >= -(-len(ids[2]) // 39)
    while eng.has_work:
        eng.step()
    for seq, want in ((first, contiguous[0]), (second, contiguous[2])):
        r = eng.result(seq)
        assert (r.token_ids, list(r.logprobs)) == want
