"""`margin` (MarginGate) and `verify-all`.

Every step runs on the fast batched path. When the protected request's top-1
minus top-2 logit (fp32) is below `tau`, or an exact tie, the verifier runs and
repairs (see `verifying` for the repair modes; `replay` is the default).
`verify-all` is tau = infinity with `column-always`: per-token verification.
"""
from __future__ import annotations

import math

import torch

from ..engine.sequence import Sequence
from .verifying import VerifyingPolicy

DEFAULT_TAU = 0.5  # used when the model has no calibrated profile; see README


def parse_tau(tau) -> float:
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a number, got {tau!r}") from None
    if math.isnan(value) or value < 0:
        raise ValueError(f"tau must be a number >= 0, got {tau!r}")
    return value


def margin_of(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


class MarginPolicy(VerifyingPolicy):
    name = "margin"

    def __init__(self, tau: float = DEFAULT_TAU, repair: str = "replay", precision: str = "bf16",
                 strict: bool = True):
        super().__init__(repair, precision, strict)
        self.tau = parse_tau(tau)

    def settings(self) -> dict:
        return {"tau": self.tau if math.isfinite(self.tau) else "inf", **super().settings()}

    def gate(self, seq: Sequence, logits: torch.Tensor) -> bool:
        margin = margin_of(logits)
        seq.stats["min_margin"] = min(seq.stats["min_margin"], margin)
        return margin < self.tau or margin == 0.0  # an exact tie always triggers


class VerifyAllPolicy(MarginPolicy):
    name = "verify-all"

    def __init__(self, precision: str = "bf16", **_):
        super().__init__(tau=math.inf, repair="column-always", precision=precision)
