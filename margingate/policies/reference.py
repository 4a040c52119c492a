"""`reference`: the request decoded as if alone, through the verifier's kernels at every step.

Its rows go through the invariant kernels inside the shared batch, which is bitwise what
decoding alone computes. In fp32 the verifier itself recomputes every step (a fp32 pass
cannot share the bf16 forward).
"""
from __future__ import annotations

import torch

from ..engine.policy import Policy, VerifyJob
from ..engine.sampling import RowChoices
from ..engine.sequence import Sequence

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the verifier's precisions (options.PRECISIONS)


class ReferencePolicy(Policy):
    name = "reference"

    def __init__(self, spec):
        super().__init__(spec)
        self.precision = DTYPES[spec.verifier_precision]
        self.exact_attention = self.precision == torch.bfloat16
        self.speculates = self.exact_attention  # in fp32 the verifier recomputes every step

    def propose(self, seq: Sequence, step: RowChoices) -> VerifyJob | None:
        if self.exact_attention:
            return None
        return VerifyJob(seq, seq.last_fed_pos, seq.last_fed_pos, self.precision)

    def commit(self, seq: Sequence, step: RowChoices, verified: RowChoices | None) -> None:
        seq.output_ids.append((step if verified is None else verified).tokens[-1])

    def settings(self) -> dict:
        return {"verifier_precision": self.spec.verifier_precision}
