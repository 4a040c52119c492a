"""The determinism policies against the reference: repairs, rollbacks, padding, kernels. That each
deterministic policy gives the reference's tokens in any batch is the contract's (determinism/test_contract.py)."""
from __future__ import annotations

import pytest
import torch
from kv_helpers import span
from prompt_sets import HET8

from margingate.engine import Request
from margingate.engine.policy import VerifyJob
from margingate.options import SamplingParams

TOKENS = 40


@pytest.fixture(scope="module")
def ids(llm, prompts):
    return [llm.tokenizer.encode_prompt(prompts[i]) for i in HET8]


@pytest.fixture(scope="module")
def ref(references):
    return references.tokens(HET8, TOKENS, ignore_eos=True)


def batch(llm, ids, make, **kw):
    reqs = [Request(x, TOKENS, make(), ignore_eos=True, request_id=f"r{i}", **kw) for i, x in enumerate(ids)]
    return llm.engine.generate(reqs)


@pytest.mark.parametrize("name", ["margin", "dvr"])
def test_injected_mismatch_rolls_back_to_the_reference(llm, ids, ref, name):
    """A wrong token forced on the fast path (LLM-42's skip-mismatch) is found by the
    replay, rolled back, and the output still equals the reference."""
    def make():
        p = llm.policy(name)
        p.inject_flip_at = 3
        return p

    out = batch(llm, ids[:4], make)
    assert [r.token_ids for r in out] == ref[:4]
    for r in out:
        assert r.stats["injected"] == 1 and r.stats["rollbacks"] >= 1 and r.stats["missed_flips"] >= 1


@pytest.mark.slow  # two margin runs of 8 prompts (the contract runs deferral)
def test_deferred_margin_shares_passes(llm, ids, ref):
    """Deferral (the default) and verifying each near-tie at once give the same, reference,
    tokens; deferral runs fewer verifier passes, and holds flagged tokens until checked."""
    engine = llm.engine
    calls = {}
    for defer in (0, 8):
        before = engine.totals["verify"].calls
        out = batch(llm, ids, lambda: llm.policy("margin", defer=defer))
        calls[defer] = engine.totals["verify"].calls - before
        assert [r.token_ids for r in out] == ref
        assert all(r.stats["defer"] == defer for r in out)
    assert calls[8] < calls[0]

    seq = engine.add_request(Request(ids[0], TOKENS, llm.policy("margin", tau=1e9, defer=4), ignore_eos=True,
                                     request_id="held"))
    engine.step()  # prefill: the first token
    engine.step()  # the first decode step: its token is flagged (tau huge) and held
    assert seq.state.flagged and seq.policy.releasable(seq) < len(seq.output_ids)
    while engine.has_work:
        engine.step()
    assert seq.output_ids == ref[0][:len(seq.output_ids)] and not seq.state.flagged


def test_defer_needs_strict_replay(llm):
    assert llm.policy("margin", strict=False, defer=8).defer == 0
    assert llm.policy("margin", repair="column", defer=8).defer == 0
    with pytest.raises(ValueError, match="defer"):
        llm.policy("margin", defer=-1)


def test_non_strict_keeps_the_injected_token(llm, ids, ref):
    """--no-strict never rolls back: the injected token stays (inverse control for strict mode)."""
    def make():
        p = llm.policy("margin", strict=False)
        p.inject_flip_at = 3
        return p

    out = batch(llm, ids[:2], make)
    for r, want in zip(out, ref[:2]):
        assert r.stats["rollbacks"] == 0 and r.token_ids[3] != want[3]


def test_replay_leaves_canonical_columns(llm, ids):
    """After a strict margin request finishes, every K/V column it wrote equals, bitwise,
    what decoding alone with the verifier writes."""
    engine = llm.engine

    def run(seqs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Step until they finish; the K/V of every position each fed, read from its last block table (its
        blocks are free once it leaves, but nothing is allocated before they are read)."""
        tables = {}
        while engine.has_work:
            engine.step()
            tables.update({s.request_id: torch.tensor(s.cache.blocks) for s in seqs if s.cache and s.cache.blocks})
        return [span(engine.kv, tables[s.request_id], 0, s.num_tokens - 1) for s in seqs]

    seqs = [engine.add_request(Request(x, TOKENS, llm.policy("margin"), ignore_eos=True, request_id=f"c{i}"))
            for i, x in enumerate(ids[:4])]
    margin_cols = run(seqs)  # the last token is never fed back
    for s, (mk, mv) in zip(seqs, margin_cols):
        alone = engine.add_request(Request(s.request.prompt_ids, TOKENS, llm.policy("reference"),
                                           ignore_eos=True, request_id=f"a-{s.request_id}"))
        (ak, av), = run([alone])
        assert alone.output_ids == s.output_ids
        assert torch.equal(ak, mk) and torch.equal(av, mv)


def test_column_repair_is_the_papers(llm, ids, ref):
    """The paper's column repair runs, and reports its own figures; on mixed batches here it
    does not guarantee the reference (the history drifted), which `check` measures."""
    out = batch(llm, ids, lambda: llm.policy("margin", repair="column"))
    for r in out:
        assert r.stats["repair"] == "column" and r.stats["rollbacks"] == 0
    assert sum(r.stats["triggers"] for r in out) > 0 and sum(r.stats["replayed_tokens"] for r in out) > 0


def test_dvr_padded_pass_is_independent_of_its_neighbours(llm, ids):
    """A DVR window verified alone (padded with dummy rows to group x window) gives bitwise the
    same logits as the same window verified beside other requests' windows."""
    engine = llm.engine
    seqs = [engine.add_request(Request(x, 12, llm.policy("fast"), ignore_eos=True, request_id=f"d{i}"))
            for i, x in enumerate(ids[:3])]
    for _ in range(8):
        engine.step()
    job = lambda s: VerifyJob(s, s.prompt_len, s.last_fed_pos - 1, torch.bfloat16, pad_to=8, group=4)  # noqa: E731
    alone = engine.verifier.recompute([job(seqs[0])])[0]
    together = engine.verifier.recompute([job(s) for s in seqs])[0]
    assert torch.equal(alone, together)
    for s in seqs:
        engine.abort(s.request_id)
    engine.step()


def test_sampling_is_reproducible_when_seeded(llm, ids):
    """temperature > 0 with a seed: the same tokens alone and in a batch; another seed differs."""
    make = lambda seed, x: Request(x, 16, llm.policy("margin"), sampling=SamplingParams(0.8, seed))  # noqa: E731
    alone = llm.engine.generate([make(7, ids[0])])[0].token_ids
    mixed = llm.engine.generate([make(7, ids[0]), *[make(1, x) for x in ids[1:6]]])
    assert mixed[0].token_ids == alone
    assert llm.engine.generate([make(8, ids[0])])[0].token_ids != alone


def test_layercast_runs_in_fp32(llm, ids, monkeypatch):
    """layercast's decode forwards compute in fp32 (over bf16 weights), its prompts in bf16 like
    every request's; it reports itself and promises nothing."""
    dtypes = []
    forward = llm.model.forward

    def spy(*args, dtype, **kw):
        dtypes.append(dtype)
        return forward(*args, dtype=dtype, **kw)

    monkeypatch.setattr(llm.model, "forward", spy)
    out = batch(llm, ids[:2], lambda: llm.policy("layercast"))
    assert all(r.stats["policy"] == "layercast" and len(r.token_ids) == TOKENS for r in out)
    assert dtypes.count(torch.float32) == TOKENS - 1 and set(dtypes) == {torch.bfloat16, torch.float32}
    assert not llm.policy("layercast").deterministic
