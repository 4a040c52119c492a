"""The margin gate at temperature > 0 compares in logit units: the top-two gap of the scores a row
samples from (logits / T + Gumbel noise) times T. Trigger rates at T = 0.5, 1 and 2 against the greedy
rate on the same prompts; the strict policy's tokens stay the reference's."""
from __future__ import annotations

import math

import pytest

from margingate.options import SamplingParams
from margingate.policies import margin as margin_module

TOKENS = 24


def run(llm, prompts, temperature, monkeypatch):
    """(every gate's score gap, the reported trigger rate, tokens) for margin (strict replay, no deferral)."""
    gaps, measure = [], margin_module.margin_of
    monkeypatch.setattr(margin_module, "margin_of", lambda row: gaps.append(measure(row)) or gaps[-1])
    sampling = SamplingParams(temperature=temperature, seed=5)
    out = llm.generate(prompts, max_new_tokens=TOKENS, ignore_eos=True, sampling=sampling,
                       policy=llm.policy("margin", defer=0))
    monkeypatch.setattr(margin_module, "margin_of", measure)
    rate = sum(c.stats["triggers"] for c in out) / sum(c.stats["steps"] for c in out)
    return gaps, rate, [c.token_ids for c in out]


@pytest.mark.slow  # about 9 s on 2 cores
def test_trigger_rate_in_logit_units_at_every_temperature(llm, prompts, monkeypatch):
    chosen = prompts[:6]
    tau = llm.policy("margin").tau
    greedy = run(llm, chosen, 0.0, monkeypatch)[1]
    assert greedy > 0
    for t in (0.5, 1.0, 2.0):
        gaps, rate, tokens = run(llm, chosen, t, monkeypatch)
        new = sum(g * t < tau or g == 0 for g in gaps) / len(gaps)  # the gate's rule: score gap x T
        old = sum(g < tau for g in gaps) / len(gaps)                # the score gap itself (before)
        assert rate == pytest.approx(new), t
        print(f"T = {t}: triggers {rate:.1%} (score gap alone: {old:.1%}), greedy {greedy:.1%}")
        if t != 1.0:  # in logit units the rate stays nearer the greedy one than the raw score gap's
            assert abs(math.log(new / greedy)) < abs(math.log(max(old, 1e-9) / greedy)), (t, new, old, greedy)
        reference = llm.generate(chosen, max_new_tokens=TOKENS, ignore_eos=True, policy=llm.policy("reference"),
                                 sampling=SamplingParams(temperature=t, seed=5))
        assert tokens == [c.token_ids for c in reference], t  # strict replay: the reference's tokens
