"""The determinism contract on gpt-oss: test_contract.py's cases over a tiny random gpt-oss (attention sinks,
a sliding layer, its biased experts; tests/gpt_oss_model.py) instead of the embedded model. Every deterministic
policy on 8 different prompts in one batch, each request bitwise its prompt decoded alone by `reference`; the
other cases once each in the slow tier; and the inverse control, `fast` moving tokens, shows the assertion can
fail on this model too."""
from __future__ import annotations

import pytest
from gpt_oss_model import tiny_harmony_model

from determinism import test_contract as contract
from determinism.contract import Alone

ids, alone = contract.ids, contract.alone  # the same fixtures, over this module's `llm`


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from margingate.llm import LLM

    return LLM(str(tiny_harmony_model(tmp_path_factory.mktemp("gpt-oss"))), max_num_seqs=16)


def pairs() -> list:
    every = [(policy, "hetero-8") for policy in contract.POLICIES]
    once = [(policy, case) for case, policy in contract.DEFAULT_TIER.items()]
    return [pytest.param(p, c, marks=() if (p, c) == ("batch-invariant", "hetero-8") else pytest.mark.slow)
            for p, c in every + once]


@pytest.mark.parametrize("policy, case", pairs())
def test_gpt_oss_same_tokens_as_the_reference_alone(llm, ids, alone, policy, case):
    contract.test_same_tokens_as_the_reference_alone(llm, ids, alone, policy, case)


@pytest.mark.slow
def test_gpt_oss_control_fast_moves_tokens_in_a_batch(llm, ids):
    out = llm.engine.generate(contract.requests(llm, ids, "fast", "f"))
    with pytest.raises(AssertionError, match="differ from the request alone"):
        contract.assert_same_tokens(out, Alone(llm, contract.NEW, "fast").of(out, contract.NEW), "fast, hetero-8")
