"""`margin` (MarginGate) and `verify-all`.

Every step runs on the fast batched path. When the protected request's top-1
minus top-2 logit (fp32) is below `tau`, or an exact tie, the verifier runs and
repairs (at temperature T > 0: the top-two gap of the scores it samples from, times T, so the
gap is in logit units whatever T) (see `verifying` for the repair modes; `replay` is the default).
`verify-all` is tau = infinity with `column-always`: per-token verification.

Deferral (`defer` = D > 0, strict `replay` only): a flagged token is held, not
released, for up to D more steps before its check is due, and every protected
request rides along on any pass that runs. Every verifier pass has a fixed
cost on top of its rows (a forward streams all the weights once), and with 8-16
requests each flagging ~11 % of steps, verifying every near-tie at once pays it
at most steps; sharing passes pays it about once per D steps. A flip found late rolls back the
tokens decoded after it (counted in `rollbacks` and `discarded_tokens`); output
is the same either way, since strict replay checks every token.
"""
from __future__ import annotations

import math

import torch

from ..engine.device_rows import DeviceRows, margins
from ..engine.sampling import RowChoices
from ..engine.sequence import Sequence
from .verifying import VerifyingPolicy


def margin_of(logits: torch.Tensor | DeviceRows) -> float:
    """The last row's gap between its best and second-best value."""
    return margins(logits[-1:])[-1]


class MarginPolicy(VerifyingPolicy):
    name = "margin"

    def __init__(self, spec):
        super().__init__(spec)
        self.tau = spec.tau  # `PolicySpec.build` filled in the model's when the caller gave none
        # deferring needs the strict replay: only it can take back a token decoded after a late flip
        self.defer = spec.defer if self.deterministic else 0

    def settings(self) -> dict:
        return {"tau": self.tau if math.isfinite(self.tau) else "inf", **super().settings(), "defer": self.defer}

    def gate(self, seq: Sequence, step: RowChoices) -> bool:
        """`step.scores` are what the row chooses from: logits / T plus Gumbel noise at temperature T > 0.
        Their top-two gap times T is in logit units, the units tau is calibrated in (at T = 1 / 2 the raw
        score gap would make the gate fire half / twice as often for the same risk)."""
        margin = margin_of(step.scores) * (seq.request.sampling.temperature or 1.0)
        seq.state.min_margin = min(seq.state.min_margin, margin)
        return margin < self.tau or margin == 0.0  # an exact tie always triggers

    def propose(self, seq: Sequence, step: RowChoices):
        if not self.defer:
            return super().propose(seq, step)
        if self.injecting(seq):
            return None
        state = seq.state
        if self.gate(seq, step):
            state.triggers += 1
            state.flagged.add(seq.next_pos)  # the position of the token this step emits
        if state.flagged and seq.next_pos - min(state.flagged) >= self.defer:
            return self.job(seq)
        return None

    def join(self, seq: Sequence, step: RowChoices):
        return self.job(seq) if self.defer and not self.injecting(seq) else None


class VerifyAllPolicy(MarginPolicy):
    """Every step verified, the verifier's column always kept: the history stays canonical."""
    name = "verify-all"

    def __init__(self, spec):
        super().__init__(spec.replace(tau=math.inf, repair="column-always", strict=True, defer=0))

    def gate(self, seq: Sequence, step: RowChoices) -> bool:
        """Every step. A step whose grammar allows one token has one finite score, an infinite margin,
        which `margin < tau` let through on the fast path: its fast K/V column stayed, and every later
        verified row read it (logprobs unlike batch-invariant's, both claimed guaranteed: issue 47)."""
        super().gate(seq, step)  # min_margin, for the report
        return True
