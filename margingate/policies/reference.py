"""`reference`: the request decoded as if alone, through the verifier's kernels at every step.

Its rows go through the invariant kernels inside the shared batch, which is bitwise what
decoding alone computes. In fp32 the verifier itself recomputes every step (a fp32 pass
cannot share the bf16 forward).
"""
from __future__ import annotations

import torch

from ..engine.policy import Policy, VerifyJob
from ..engine.sequence import Sequence

PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_precision(name: str) -> torch.dtype:
    if name not in PRECISIONS:
        raise ValueError(f"unknown verifier precision {name!r} (choose from {', '.join(PRECISIONS)})")
    return PRECISIONS[name]


class ReferencePolicy(Policy):
    name = "reference"
    deterministic = True

    def __init__(self, precision: str = "bf16"):
        self.precision = parse_precision(precision)
        self.precision_name = precision
        self.invariant_decode = self.precision == torch.bfloat16

    @classmethod
    def from_spec(cls, spec, default_tau: float) -> ReferencePolicy:
        return cls(spec.precision)

    def propose(self, seq: Sequence, logits: torch.Tensor) -> VerifyJob | None:
        if self.invariant_decode:
            return None
        return VerifyJob(seq, seq.last_pos, seq.last_pos, self.precision)

    def commit(self, seq: Sequence, logits: torch.Tensor, verified: torch.Tensor | None) -> None:
        row = logits if verified is None else verified[-1]
        seq.output_ids.append(int(torch.argmax(row)))

    def settings(self) -> dict:
        return {"verifier_precision": self.precision_name}
