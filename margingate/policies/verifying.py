"""The machinery shared by every policy that verifies: what to recompute, how to repair.

A subclass says *when* to verify (`gate`): MarginGate at a near-tie, LLM-42 when
a window is full, verify-all at every step. Repairs:

- `replay`: keep the request's history canonical, lazily. The verifier
  recomputes, in one pass, every position since the last canonical one (its
  kernels are row-independent, so the rows equal decoding alone bitwise),
  overwrites those K/V columns, checks the tokens emitted since then against
  the canonical argmax (a mismatch is a flip the gate missed: strict mode rolls
  back to it), and picks the current token from canonical logits. At the end a
  strict request replays its unverified tail the same way, so its output equals
  the reference exactly. This is also LLM-42's decode-verify-rollback.
- `column` (the MarginGate paper, §3.2): recompute the current step alone from
  the request's (drifted) cache; on disagreement emit the verifier's token and
  keep its K/V column. `column-always` keeps the column even when the tokens
  agree; `none` keeps the fast column (the §4.4 ablation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..engine.policy import Policy, PolicyState, VerifyJob
from ..engine.sampling import RowChoices
from ..engine.sequence import Sequence
from ..models.kv_cache import Column
from .reference import DTYPES


@dataclass
class VerifyState(PolicyState):
    """What a verifying policy remembers about one request."""
    # positions [0, canonical_len) hold K/V written by the verifier's kernels (the prompt's always do)
    canonical_len: int
    # positions whose token the gate flagged (low margin) and that still wait for the verifier
    flagged: set[int] = field(default_factory=set)
    pending: Column | None = None     # `column` repair: the fast column, restored if the verifier agrees
    triggers: int = 0
    repairs: int = 0
    replayed_tokens: int = 0
    rollbacks: int = 0
    missed_flips: int = 0             # flips the gate did not see, found by a later replay
    discarded_tokens: int = 0         # tokens decoded after a flip and taken back
    injected: int = 0                 # testing: the wrong token was emitted
    min_margin: float = math.inf

    def verified_through(self, num_tokens: int) -> None:
        """Every position below `num_tokens` now holds the verifier's K/V."""
        self.canonical_len = num_tokens
        self.flagged.clear()

    def stats(self) -> dict:
        return {"triggers": self.triggers, "repairs": self.repairs, "replayed_tokens": self.replayed_tokens,
                "rollbacks": self.rollbacks, "missed_flips": self.missed_flips,
                "discarded_tokens": self.discarded_tokens, "injected": self.injected,
                "min_margin": self.min_margin if math.isfinite(self.min_margin) else None}


class VerifyingPolicy(Policy):
    name = "verifying"
    #: pad each replay job to this many rows (a fixed verifier shape, as LLM-42 does)
    pad_to: int | None = None

    def __init__(self, spec):
        super().__init__(spec)
        self.repair, self.strict = spec.repair, spec.strict
        self.precision = DTYPES[spec.verifier_precision]
        #: testing aid (LLM-42's skip-mismatch): emit the fast top-2 instead of top-1 once, at this
        #: output index and without triggering, so that the repair has a real missed flip to find
        self.inject_flip_at = spec.inject_flip_at

    def new_state(self, seq: Sequence) -> VerifyState:
        return VerifyState(canonical_len=seq.prompt_len)  # the prompt is prefilled by the invariant kernels

    def settings(self) -> dict:
        return {"repair": self.repair, "verifier_precision": self.spec.verifier_precision, "strict": self.strict}

    def gate(self, seq: Sequence, step: RowChoices) -> bool:
        """Verify this step?"""
        raise NotImplementedError

    def injecting(self, seq: Sequence) -> bool:
        return self.inject_flip_at == len(seq.output_ids) and not seq.state.injected

    def propose(self, seq: Sequence, step: RowChoices) -> VerifyJob | None:
        if self.injecting(seq):
            return None
        if not self.gate(seq, step):
            return None
        seq.state.triggers += 1
        return self.job(seq)

    def job(self, seq: Sequence) -> VerifyJob:
        """Verify this step's token (with `replay`, everything since the last canonical position)."""
        pos = seq.last_fed_pos
        if self.repair == "replay":
            return VerifyJob(seq, seq.state.canonical_len, pos, self.precision, self.pad_to)
        if self.repair != "column-always":
            seq.state.pending = seq.cache.read(pos)  # the fast column, maybe restored
        return VerifyJob(seq, pos, pos, self.precision)

    def commit(self, seq: Sequence, step: RowChoices, verified: RowChoices | None) -> None:
        state: VerifyState = seq.state
        fast_token = step.tokens[-1]
        if verified is None:
            if self.injecting(seq):
                state.injected = 1
                fast_token = int(torch.topk(step.scores[-1], 2).indices[1])
            seq.output_ids.append(fast_token)
            return
        state.replayed_tokens += len(verified.tokens)
        if self.repair == "replay":
            if self._check_history(seq, list(zip(verified.positions, verified.tokens))[:-1]):
                return  # rolled back to a flip; that step's token is already fixed
            state.verified_through(seq.next_pos)
        token = verified.tokens[-1]
        if token != fast_token:
            state.repairs += 1
        keep_column = self.repair in ("replay", "column-always") or (self.repair == "column" and token != fast_token)
        if not keep_column:
            seq.cache.overwrite(seq.last_fed_pos, state.pending)
        state.pending = None
        seq.output_ids.append(token)

    def _check_history(self, seq: Sequence, canonical: list[tuple[int, int]]) -> bool:
        """`canonical`: (position, the token the verifier's row chooses there) for positions whose token was
        emitted on the fast path. Returns True if it rolled back to a mismatch."""
        state: VerifyState = seq.state
        for pos, expected in canonical:
            if expected == seq.token_at(pos):
                continue
            if pos in state.flagged:  # the gate saw it; its check was deferred
                state.repairs += 1
            else:
                state.missed_flips += 1
            if not self.strict:
                continue
            state.rollbacks += 1
            state.discarded_tokens += seq.num_tokens - pos
            seq.rollback(pos)
            state.verified_through(pos)
            seq.output_ids.append(expected)
            return True
        return False

    def finish_job(self, seq: Sequence) -> VerifyJob | None:
        last_written = seq.last_fed_pos - 1  # the last token was never fed: its K/V are not written
        if self.repair != "replay" or not self.strict or seq.state.canonical_len > last_written:
            return None
        return VerifyJob(seq, seq.state.canonical_len, last_written, self.precision, self.pad_to)

    def confirm_finish(self, seq: Sequence, verified: RowChoices) -> bool:
        seq.state.replayed_tokens += len(verified.tokens)
        if self._check_history(seq, list(zip(verified.positions, verified.tokens))):
            return False
        seq.state.verified_through(seq.last_fed_pos)  # every position before the last token's
        return True

    def releasable(self, seq: Sequence) -> int:
        if self.repair == "replay" and self.strict:  # verified tokens only
            return min(len(seq.output_ids), seq.state.canonical_len - seq.prompt_len + 1)
        return len(seq.output_ids)
