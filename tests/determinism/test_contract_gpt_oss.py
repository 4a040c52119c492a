"""The determinism contract on gpt-oss: test_contract.py's cases over a tiny random gpt-oss (attention sinks,
a sliding layer, its biased experts; tests/gpt_oss_model.py) instead of the embedded model. Every deterministic
policy on 8 different prompts in one batch, each request bitwise its prompt decoded alone by `reference`; the
other cases once each. All in the slow tier (11-35 s each here). No inverse control here: on this tiny model
`fast` (the invariant kernels with attention chunks aligned to the batch) moved no token in a batch of 8 (measured),
so a control would not fail; test_contract.py's shows the assertion can fail."""
from __future__ import annotations

import pytest
from gpt_oss_model import tiny_harmony_model

from determinism import test_contract as contract

ids, alone = contract.ids, contract.alone  # the same fixtures, over this module's `llm`


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from margingate.llm import LLM

    return LLM(str(tiny_harmony_model(tmp_path_factory.mktemp("gpt-oss"))), max_num_seqs=16)


def pairs() -> list:
    every = [(policy, "hetero-8") for policy in contract.POLICIES]
    once = [(policy, case) for case, policy in contract.DEFAULT_TIER.items()]
    return [pytest.param(p, c, marks=pytest.mark.slow) for p, c in every + once]


@pytest.mark.parametrize("policy, case", pairs())
def test_gpt_oss_same_tokens_as_the_reference_alone(llm, ids, alone, policy, case):
    contract.test_same_tokens_as_the_reference_alone(llm, ids, alone, policy, case)
