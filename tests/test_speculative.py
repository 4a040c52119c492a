"""Speculative decoding on the embedded model: the output with proposals is bitwise the output
without, greedy and seeded, alone and sharing a batch with plain requests, tokens and logprobs."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from margingate.cli import build_parser
from margingate.cli_args import speculative_config
from margingate.data.prompts import Prompt
from margingate.engine import Request
from margingate.engine.proposers import NgramProposer
from margingate.engine.step_profile import StepProfile
from margingate.llm import LLM
from margingate.options import PolicySpec, SamplingParams, SpeculativeConfig, SpeculativeError
from margingate.policies import POLICIES, build

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
COPYING = [f"Repeat this code exactly, then rename add to plus:\n{CODE}",
           "Copy this sentence twice: The quick brown fox jumps over the lazy dog.",
           "Summarize in one line: The meeting moved to Tuesday at 10am in room 4 because room 2 is closed."]
NGRAM = SpeculativeConfig("ngram", num_tokens=4)
SEEDED = SamplingParams(temperature=0.8, seed=11, repetition_penalty=1.05, logprobs=2)


def feed_every_proposal(llm, monkeypatch):
    """The engine feeds every proposal asked for: the tests that count accepted proposals must not
    depend on what the step cost model makes of this machine's timings."""
    monkeypatch.setattr(llm.engine, "config", dataclasses.replace(llm.engine.config, speculative_cost_model=False))
    return llm


@pytest.fixture(scope="module")
def copying(llm):
    return [llm.tokenizer.encode_prompt(Prompt("chat", ({"role": "user", "content": m},), None, "t"))
            for m in COPYING]


def run(llm, ids, policy, sampling, speculative, tokens=24):
    """Each request's (tokens, logprobs, stats); `speculative[i]` is request i's config (None: plain)."""
    reqs = [Request(x, tokens, llm.policy(policy), request_id=f"s{i}", sampling=sampling, speculative=spec)
            for i, (x, spec) in enumerate(zip(ids, speculative))]
    return [(r.token_ids, r.logprobs, r.stats) for r in llm.engine.generate(reqs)]


def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(n_max=3, n_min=1)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # the latest earlier match
    assert p.propose([1, 2, 3, 4, 5, 3], 3) == [4, 5, 3]                # falls back to n = 1
    assert p.propose([1, 2, 3], 4) == []                                # nothing repeats
    assert NgramProposer(3, 2).propose([5, 6, 7, 6], 2) == []           # n below n_min is not tried


@pytest.mark.parametrize("policy, sampling", [("batch-invariant", SamplingParams(logprobs=2)),
                                              ("batch-invariant", SEEDED),
                                              pytest.param("reference", SamplingParams(), marks=pytest.mark.slow)],
                         ids=["greedy", "seeded", "reference"])
def test_speculative_equals_plain_bitwise(llm, copying, policy, sampling, monkeypatch):
    """B = 1 and a mixed batch (speculating and plain requests in the same steps): the same tokens
    and logprobs as plain decoding, and proposals were really accepted (the test can fail)."""
    feed_every_proposal(llm, monkeypatch)
    plain = run(llm, copying, policy, sampling, [None] * 3)
    alone = run(llm, copying[:1], policy, sampling, [NGRAM])[0]
    mixed = run(llm, copying, policy, sampling, [NGRAM, None, NGRAM])
    assert alone[:2] == plain[0][:2]
    for i in range(3):
        assert mixed[i][:2] == plain[i][:2], f"request {i}"
    stats = alone[2]
    # drafts were accepted, so rows after d1..di chose tokens: the rows this test exists for (seeded:
    # penalties over d1..di, noise keyed at each row's own position) really ran and agreed
    assert stats["speculation_exact"] is True and stats["accepted_tokens"] > 0
    assert stats["speculative_steps"] < len(alone[0])


def test_a_step_that_fails_mid_speculation_leaves_the_sequence_as_it_was(llm, copying, monkeypatch):
    """The drafts are never the sequence's until accepted: a forward that raises after the proposals
    were made leaves its tokens, logprobs, counts and speculation figures as before the step, and the
    request then decodes on to the plain output."""
    feed_every_proposal(llm, monkeypatch)
    plain = run(llm, copying[:1], "batch-invariant", SEEDED, [None], tokens=12)[0]
    engine = llm.engine
    seq = engine.add_request(Request(copying[0], 12, llm.policy("batch-invariant"), request_id="fails",
                                     sampling=SEEDED, speculative=NGRAM))
    while seq.speculation.steps < 1 and seq.finish_reason is None:  # into the decode: copied text, proposals
        engine.step()
    assert seq.finish_reason is None, "the request finished before it speculated"

    def state():
        s = seq.speculation
        return (list(seq.output_ids), list(seq.drafts), list(seq.logprobs), seq.num_tokens, seq.steps,
                s.steps, s.proposed, s.accepted, seq.finish_reason)

    before, fed, forward = state(), [], engine.runner.step

    def failing(prefills, batch):
        fed.append(list(seq.drafts))
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(engine.runner, "step", failing)
    with pytest.raises(RuntimeError, match="the forward failed"):
        engine.step()
    assert fed[0], "the failed step carried proposals"
    assert state() == before
    monkeypatch.setattr(engine.runner, "step", forward)
    while seq.finish_reason is None:
        engine.step()
    assert (seq.output_ids, seq.logprobs) == (plain[0], plain[1])


def test_the_policies_that_speculate_say_so():
    """Speculation commits accepted drafts with no verifier job: only the policies that never verify a
    step speculate, an explicit list (fp32 reference recomputes every step in the verifier)."""
    assert {name for name in POLICIES if build(PolicySpec(name)).speculates} == {
        "fast", "fast-library", "reference", "batch-invariant", "layercast"}
    assert not build(PolicySpec("reference", verifier_precision="fp32")).speculates


def test_verifying_policies_decode_without_speculation_and_say_so(llm, copying):
    plain = run(llm, copying[:2], "margin", SamplingParams(), [None, None], tokens=12)
    spec = run(llm, copying[:2], "margin", SamplingParams(), [NGRAM, NGRAM], tokens=12)
    assert [s[0] for s in spec] == [p[0] for p in plain]
    assert spec[0][2]["speculation"] == "off" and "verifies" in spec[0][2]["speculation_off_reason"]


def test_step_profile_feeds_proposals_only_where_they_pay():
    memory_bound, compute_bound = StepProfile(), StepProfile()
    for rows in (1, 2, 3, 5, 1, 4):
        memory_bound.observe(rows, 0.020 + 0.0002 * rows)    # reading the weights dominates
        compute_bound.observe(rows + 16, 0.001 + 0.002 * (rows + 16))  # every row costs its arithmetic
    assert memory_bound.fit() == pytest.approx((0.020, 0.0002))
    assert memory_bound.worth(0.5, rows=1, k=8) >= 4            # even a coin-flip proposer pays at B = 1
    assert memory_bound.worth(0.01, rows=1, k=8) == 0           # one that is never right does not
    assert compute_bound.worth(0.9, rows=16, k=8) == 0          # a large batch: nothing pays
    same = StepProfile()
    for _ in range(5):
        same.observe(4, 0.01)
    # no fit yet: explore with one proposal, so the next step's row count differs from the last ones
    assert same.fit() is None and same.worth(0.5, rows=4, k=3) == 1 and same.worth(0.5, rows=5, k=3) == 0


def test_the_engine_holds_proposals_that_would_not_pay(llm, copying, monkeypatch):
    """A step profile of a compute-bound machine: the request feeds no proposals, says so, same tokens."""
    cost = StepProfile()
    for rows in range(1, 9):
        cost.observe(rows, 0.0001 + 0.01 * rows)
    monkeypatch.setattr(cost, "observe", lambda rows, seconds: None)  # keep that profile for the test
    monkeypatch.setattr(llm.engine, "step_profile", cost)
    plain = run(llm, copying[:1], "batch-invariant", SamplingParams(), [None], tokens=10)[0]
    held = run(llm, copying[:1], "batch-invariant", SamplingParams(), [NGRAM], tokens=10)[0]
    assert held[0] == plain[0]
    assert held[2]["proposed_tokens"] == 0 and held[2]["speculation_held_steps"] == 8


def test_fast_may_differ_and_the_report_says_so(llm, copying):
    stats = run(llm, copying[:1], "fast", SamplingParams(), [NGRAM], tokens=8)[0][2]
    assert stats["speculation_exact"] is False


@pytest.mark.parametrize("options, option", [
    ({"num_tokens": 0}, "num_tokens"), ({"num_tokens": 17}, "num_tokens"), ({"num_tokens": 2.0}, "num_tokens"),
    ({"method": "medusa"}, "method"), ({"ngram_max": 0}, "ngram_max"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
])
def test_bad_options_name_the_option(options, option):
    with pytest.raises(SpeculativeError) as exc:
        SpeculativeConfig(**options)
    assert exc.value.option == option and option in str(exc.value)


def test_cli_flags():
    parser = build_parser()
    args = parser.parse_args(["generate", "--speculative", "ngram", "--num-speculative-tokens", "6", "x"])
    assert speculative_config(args) == SpeculativeConfig("ngram", 6)
    assert speculative_config(parser.parse_args(["generate", "x"])) is None
    with pytest.raises(SystemExit, match="--num-speculative-tokens"):
        speculative_config(parser.parse_args(["generate", "--speculative", "ngram",
                                              "--num-speculative-tokens", "99", "x"]))


@pytest.mark.parametrize("draft", ["smollm2-135m", "tiny"])
def test_draft_proposer_equals_plain(copying, tiny_random_model, draft, monkeypatch):
    """A draft model proposes; the target decides. The target as its own draft accepts every greedy
    proposal, a random draft almost none: the same tokens either way."""
    llm = feed_every_proposal(LLM(max_num_seqs=3, max_model_len=512,
                                  draft_model=str(tiny_random_model) if draft == "tiny" else draft), monkeypatch)
    spec = SpeculativeConfig("draft", num_tokens=3)
    plain = run(llm, copying[:2], "batch-invariant", SamplingParams(), [None, None], tokens=16)
    before = Request([1]).request_id
    drafted = run(llm, copying[:2], "batch-invariant", SamplingParams(), [spec, None], tokens=16)
    after = Request([1]).request_id  # the draft's own sequences took no default id of the user's
    assert int(after.removeprefix("req-")) == int(before.removeprefix("req-")) + 1
    assert [d[0] for d in drafted] == [p[0] for p in plain]
    stats = drafted[0][2]
    assert stats["proposed_tokens"] > 0
    if draft != "tiny":
        assert stats["accepted_tokens"] == stats["proposed_tokens"]
    draft_pool = llm.engine.draft.kv
    # every request gave its draft blocks back (the draft's runner keeps its sink block)
    assert draft_pool.num_free == draft_pool.num_blocks - 1


def test_a_draft_needs_the_targets_tokenizer(tiny_random_model, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_random_model, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000}))
    with pytest.raises(SpeculativeError, match="vocabulary has 1000 tokens") as exc:
        LLM(max_num_seqs=1, max_model_len=64, draft_model=str(other))
    assert exc.value.option == "draft_model"
    with pytest.raises(SpeculativeError, match="needs a draft model"):
        SpeculativeConfig("draft").check(None)
