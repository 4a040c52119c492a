"""`dvr`: LLM-42's decode-verify-rollback.

Decode `window` tokens on the fast path, then verify the whole window in one
replay pass of fixed shape (each job padded to `window` rows, up to `group`
requests per pass, the group padded with dummy jobs), accept the matching
prefix plus the verifier's next token, roll back the rest. Only verified tokens
are released. It is the `replay` repair with the gate "the window is full"
instead of "the margin is small".
"""
from __future__ import annotations

from ..engine.sampling import RowChoices
from ..engine.sequence import Sequence
from .verifying import VerifyingPolicy


class DVRPolicy(VerifyingPolicy):
    name = "dvr"

    def __init__(self, spec):
        super().__init__(spec.replace(repair="replay", strict=True))
        self.window, self.group = spec.window, spec.group
        self.pad_to = spec.window

    def settings(self) -> dict:
        return {"window": self.window, "group": self.group, "verifier_precision": self.spec.verifier_precision}

    def gate(self, seq: Sequence, step: RowChoices) -> bool:
        return seq.next_pos - seq.state.canonical_len >= self.window

    def propose(self, seq: Sequence, step: RowChoices):
        job = super().propose(seq, step)
        if job is not None:
            job.group = self.group
        return job

    def finish_job(self, seq):
        job = super().finish_job(seq)
        if job is not None:
            job.group = self.group
        return job
