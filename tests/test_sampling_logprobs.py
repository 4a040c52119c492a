"""Sampling options, logprobs and scoring on the embedded model (engine and `LLM`), and the
filters on rows built by hand.

The contract: a request's tokens *and* logprobs are a function of the request alone under a
policy that guarantees them; scoring a generated sequence gives back, bitwise, the logprobs
generation reported (the rollout / trainer match RL needs); sample i of n is the single request
with seed + i."""
from __future__ import annotations

import math

import pytest
import torch
from prompt_sets import HET8

from margingate.engine import Request
from margingate.engine.logprobs import logprobs_of
from margingate.engine.sampling import filtered
from margingate.options import SamplingError, SamplingParams

TOKENS = 20
SAMPLED = SamplingParams(temperature=1.0, seed=7, top_p=0.9, top_k=40, min_p=0.02, presence_penalty=0.4,
                         frequency_penalty=0.2, repetition_penalty=1.1, logprobs=3)


def ids_of(llm, prompts, indices):
    return [llm.tokenizer.encode_prompt(prompts[i]) for i in indices]


def run(llm, ids, policy, sampling, tokens=TOKENS, **kw):
    """`sampling`: every request's, or one per request (a list)."""
    each = sampling if isinstance(sampling, list) else [sampling] * len(ids)
    reqs = [Request(x, tokens, llm.policy(policy), ignore_eos=True, request_id=f"r{i}", sampling=sp, **kw)
            for i, (x, sp) in enumerate(zip(ids, each))]
    return llm.engine.generate(reqs)


def lps(result):
    return [(t.token, t.logprob, t.top) for t in result.logprobs]


@pytest.mark.parametrize("policy", ["batch-invariant", *(pytest.param(p, marks=pytest.mark.slow)
                                              for p in ("margin", "dvr", "verify-all"))])
def test_logprobs_alone_equal_batched_and_scored(llm, prompts, policy):
    """Guaranteed policies: each request's logprobs in a batch of 8 are bitwise its logprobs alone,
    and bitwise what scoring its output gives (margin and dvr report the verifier's rows)."""
    ids = ids_of(llm, prompts, HET8)
    sp = SamplingParams(logprobs=4)
    batched = run(llm, ids, policy, sp)
    assert llm.policy(policy).guarantees_logprobs
    for i in (0, 5):
        alone = run(llm, ids[i:i + 1], policy, sp)[0]
        assert alone.token_ids == batched[i].token_ids and lps(alone) == lps(batched[i])
        score = llm.score(ids[i], batched[i].token_ids, top_logprobs=4)
        assert score.logprobs == [t.logprob for t in batched[i].logprobs]
        assert [t.top for t in score.tokens] == [t.top for t in batched[i].logprobs]


@pytest.mark.parametrize("policy", ["margin", pytest.param("dvr", marks=pytest.mark.slow)])
def test_stream_releases_tokens_with_their_logprobs(llm, prompts, policy):
    """`Engine.release` is the one release loop (`stream` here, the server's worker alike): the events of a
    request carry its tokens with their logprobs, and its prompt's logprobs once, and joined they are the
    final result; a strict policy releases only verified tokens, so each event's logprobs are final."""
    ids = ids_of(llm, prompts, HET8[:4])
    sp = SamplingParams(logprobs=2, prompt_logprobs=1)
    reqs = [Request(x, TOKENS, llm.policy(policy), ignore_eos=True, request_id=f"r{i}", sampling=sp)
            for i, x in enumerate(ids)]
    events = list(llm.engine.stream(reqs))
    for r in reqs:
        mine = [e for e in events if e.request_id == r.request_id]
        final = mine[-1].result
        assert mine[-1].finished and sum(e.finished for e in mine) == 1
        assert [t for e in mine for t in e.token_ids] == final.token_ids
        assert [x for e in mine for x in e.logprobs] == final.logprobs
        prompt = [e.prompt_logprobs for e in mine if e.prompt_logprobs is not None]
        assert prompt == [final.prompt_logprobs] and len(final.prompt_logprobs) == len(r.prompt_ids)


def test_guaranteed_policies_report_the_same_logprobs(llm, prompts):
    """batch-invariant, margin and dvr all report the canonical rows: the same bits."""
    ids = ids_of(llm, prompts, HET8[:4])
    sp = SamplingParams(logprobs=2)
    outs = {p: run(llm, ids, p, sp) for p in ("batch-invariant", "margin", "dvr")}
    for a, b in zip(outs["batch-invariant"], outs["margin"]):
        assert lps(a) == lps(b)
    for a, b in zip(outs["batch-invariant"], outs["dvr"]):
        assert lps(a) == lps(b)


def test_logprobs_are_a_log_softmax(llm, prompts):
    out = run(llm, ids_of(llm, prompts, [0]), "batch-invariant", SamplingParams(logprobs=5))[0]
    for t in out.logprobs:
        assert t.top[0][0] == t.token  # greedy: the chosen token is the most likely
        assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
        assert sum(math.exp(lp) for _, lp in t.top) <= 1.0 + 1e-6
    rows = torch.randn(6, 1000) * 4
    got = torch.tensor([e.logprob for e in logprobs_of(rows, list(range(6)), 0)])
    want = torch.log_softmax(rows.double(), -1)[torch.arange(6), torch.arange(6)]
    assert torch.allclose(got.double(), want, atol=2e-6)
    alone = logprobs_of(rows[3:4], [3], 2)[0]  # a row's logprobs do not depend on the rows beside it
    assert alone == logprobs_of(rows, list(range(6)), 2)[3]


def test_top_logprobs_break_ties_by_token_id():
    row = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    top = logprobs_of(row, [4], 3)[0].top
    assert [t for t, _ in top] == [1, 3, 4]
    assert [t for t, _ in logprobs_of(row, [4], 2)[0].top] == [1, 3]  # a tie at the k-th value
    assert [t for t, _ in logprobs_of(row, [4], 5)[0].top] == [1, 3, 4, 2, 0]


def test_seeded_sampling_is_a_function_of_the_request(llm, prompts):
    """All the options at once: alone = in a batch, and different seeds give different samples."""
    ids = ids_of(llm, prompts, HET8)
    batched = run(llm, ids, "batch-invariant", SAMPLED)
    alone = run(llm, ids[2:3], "batch-invariant", SAMPLED)[0]
    assert alone.token_ids == batched[2].token_ids and lps(alone) == lps(batched[2])
    others = run(llm, [ids[2]] * 3, "batch-invariant", [SamplingParams(temperature=1.0, seed=s) for s in (8, 9, 10)])
    assert any(o.token_ids != alone.token_ids for o in others)


def test_filters_at_their_limits_are_greedy(llm, prompts):
    """top_k = 1 and a tiny top_p keep one token, the lowest id at a tie, as greedy does (min_p = 1
    keeps every tied token, so it is not greedy at ties: the hand-made rows test it)."""
    ids = ids_of(llm, prompts, [1, 4])
    greedy = run(llm, ids, "batch-invariant", SamplingParams())
    for sp in (SamplingParams(temperature=1.5, seed=3, top_k=1), SamplingParams(temperature=1.5, seed=3, top_p=1e-9)):
        assert [r.token_ids for r in run(llm, ids, "batch-invariant", sp)] == [r.token_ids for r in greedy], sp


def test_logit_bias_and_penalties_change_the_choice(llm, prompts):
    ids = ids_of(llm, prompts, [3])
    greedy = run(llm, ids, "batch-invariant", SamplingParams())[0].token_ids
    banned = run(llm, ids, "batch-invariant", SamplingParams(logit_bias={greedy[0]: -100}))[0].token_ids
    assert banned[0] != greedy[0] and greedy[0] not in banned
    forced = run(llm, ids, "batch-invariant", SamplingParams(logit_bias={42: 100}))[0].token_ids
    assert set(forced) == {42}
    long = run(llm, ids, "batch-invariant", SamplingParams(), tokens=60)[0].token_ids
    fresh = run(llm, ids, "batch-invariant", SamplingParams(frequency_penalty=2.0), tokens=60)[0].token_ids
    assert len(set(fresh)) > len(set(long))  # fewer repeats


def test_filters_on_hand_made_rows():
    row = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])
    kept = lambda **kw: torch.isfinite(filtered(row, SamplingParams(temperature=1.0, seed=0, **kw))[0]).tolist()  # noqa: E731
    assert kept(top_k=2) == [False, True, True, False, False]
    assert kept(top_k=1) == [False, True, False, False, False]   # a tie: the lower token id
    p = torch.softmax(row[0].double(), 0)
    assert kept(top_p=float(p[1] + p[2]) - 1e-6) == [False, True, True, False, False]
    assert kept(top_p=float(p[1] + p[2] + p[3]) + 1e-6) == [True, True, True, True, False]
    assert kept(min_p=math.exp(-1.0) - 1e-6) == [False, True, True, True, False]


def test_n_samples_fork_the_prompt_and_equal_their_single_twins(llm, prompts):
    ids = ids_of(llm, prompts, [6])[0]
    base = SamplingParams(temperature=1.0, seed=11, top_p=0.9, logprobs=1)
    pol = llm.policy("batch-invariant")
    reqs = [Request(ids, 12, pol, request_id=f"s{i}", sampling=base.for_sample(i), share_prefill="s0" if i else None)
            for i in range(4)]
    forked = llm.engine.generate(reqs)
    assert [r.cached_tokens for r in forked] == [0] + [len(ids) - 1] * 3  # the prompt computed once
    for i, r in enumerate(forked):
        twin = run(llm, [ids], "batch-invariant", SamplingParams(temperature=1.0, seed=11 + i, top_p=0.9,
                                                                logprobs=1), tokens=12)[0]
        assert r.token_ids == twin.token_ids and lps(r) == lps(twin)
    assert len({tuple(r.token_ids) for r in forked}) > 1


def test_scoring_needs_tokens_and_echo_alone_needs_no_new_token(llm):
    with pytest.raises(ValueError, match="non-empty continuation"):
        llm.score([1, 2], [])
    res = llm.engine.generate([Request([504, 3575, 314], 0, sampling=SamplingParams(prompt_logprobs=0))])[0]
    assert res.token_ids == [] and res.finish_reason == "length"
    assert res.prompt_logprobs[0] is None and [t.token for t in res.prompt_logprobs[1:]] == [3575, 314]


@pytest.mark.parametrize("kw, option", [({"top_p": 0.0}, "top_p"), ({"min_p": 2.0}, "min_p"),
                                        ({"logprobs": 21}, "logprobs"), ({"logit_bias": {1: 101}}, "logit_bias"),
                                        ({"temperature": -1}, "temperature"), ({"seed": 2 ** 64}, "seed"),
                                        ({"top_k": -3}, "top_k"), ({"repetition_penalty": 0}, "repetition_penalty")])
def test_bad_sampling_options_name_the_option(kw, option):
    with pytest.raises(SamplingError, match=option) as err:
        SamplingParams(**kw)
    assert err.value.option == option


def philox_reference(counter: list[int], key: list[int]) -> list[int]:
    """Philox4x32-10 in plain Python (Random123's definition), to check the kernels' vector one."""
    c, k0, k1 = list(counter), key[0], key[1]
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def test_philox_meets_its_known_answers():
    """Random123's known-answer vectors for Philox4x32-10: the generator is the published one."""
    from margingate.kernels.invariant import philox4x32

    kats = [([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
            ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
            ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
             [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1])]
    for counter, key, want in kats:
        assert philox_reference(counter, key) == want
        assert philox4x32(counter, key) == want


def test_gumbel_noise_is_keyed_by_seed_position_and_token():
    """The noise is -log(-log(u)), u = (2m + 1) / 2^53 from Philox words 0, 1 (even tokens) or 2, 3 (odd)
    at counter (token / 2, position lo, position hi, 0) and key seed: our log agrees with torch's to 1e-6,
    a token's noise does not depend on the vocabulary's size or the row's place, and a seed or position
    moves it. Its mean is Euler's gamma."""
    from margingate.kernels.invariant import add_gumbel_

    seed, pos = -7, 2 ** 33 + 5
    g = add_gumbel_(torch.zeros(3, 1000), seed, pos)
    key = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF]
    for token in (0, 1, 2, 3, 998, 999):
        w = philox_reference([token // 2, (pos + 1) & 0xFFFFFFFF, (pos + 1) >> 32, 0], key)[2 * (token % 2):]
        u = torch.tensor((2 * ((w[0] << 20) | (w[1] >> 12)) + 1) / 2 ** 53, dtype=torch.float64)
        assert abs(float(g[1, token]) - float(-torch.log(-torch.log(u)))) < 1e-6
    assert torch.equal(add_gumbel_(torch.zeros(1, 17), seed, pos + 2)[0], g[2, :17])
    assert not torch.equal(add_gumbel_(torch.zeros(1, 1000), seed + 1, pos)[0], g[0])
    assert not torch.equal(g[0], g[1])
    many = add_gumbel_(torch.zeros(8, 49152), 3, 0)
    assert abs(float(many.double().mean()) - 0.5772) < 0.01


def test_nucleus_reads_only_the_head_and_equals_the_whole_order():
    """top_p sorts only the head its octave masses point to; the kept tokens are those of the whole
    best-first order (ties by id) summed sequentially, on spread, peaked, tied and masked rows."""
    from margingate.engine.sampling import best_first, nucleus
    from margingate.kernels import invariant

    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        row = torch.randn(5000, generator=g) * [0.5, 2.0, 5.0, 20.0][trial % 4]
        if trial % 3 == 0:
            row[torch.randint(0, 5000, (2000,), generator=g)] = -math.inf
        if trial % 5 == 0:
            row = torch.round(row)
        p = [0.1, 0.5, 0.9, 0.99, 0.999999][trial % 5]
        e = invariant.exp_shifted(row[None], row.max()[None])[0]
        total = float(invariant.sum_exp_rows(row[None])[0])
        order = best_first(row, row.numel())
        cum = torch.tensor(e[order].double().numpy().cumsum())
        want = order[:min(int(torch.searchsorted(cum, p * total)) + 1, len(order))]
        assert torch.equal(nucleus(row, p, e, total), want), trial


def test_argmax_rows_is_torch_argmax():
    """The greedy token comes from our own argmax (torch's costs ~1 ns per vocabulary entry): the first
    maximum as torch.argmax, on random, tied (+0 and -0 too), -inf, NaN and short rows, at every
    length around the 8-lane blocks."""
    from margingate.kernels import invariant

    g = torch.Generator().manual_seed(2)
    rows = []
    for v in (1, 2, 7, 8, 9, 15, 16, 17, 23, 24, 25, 64, 100, 49152):
        rows += [torch.randn(3, v, generator=g), torch.round(torch.randn(3, v, generator=g)),
                 torch.full((1, v), -math.inf), torch.zeros(1, v)]
        signed = torch.zeros(2, v)
        signed[0, v // 2:] = -0.0
        signed[1, :v // 2] = -0.0
        rows.append(signed)
        for at in {0, v // 2, v - 1}:  # NaN first, in the middle, last; a second NaN later
            r = torch.randn(2, v, generator=g)
            r[:, at] = math.nan
            r[1, min(v - 1, at + 3)] = math.nan
            r[1, (at + 5) % v] = math.inf
            rows.append(r)
    for r in rows:
        assert invariant.argmax_rows(r) == r.argmax(-1).tolist(), r
    with pytest.raises(RuntimeError, match="empty"):
        invariant.argmax_rows(torch.zeros(2, 0))
