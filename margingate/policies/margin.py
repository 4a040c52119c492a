"""`margin` (MarginGate) and `verify-all`.

Every step runs on the fast batched path. When the protected request's top-1
minus top-2 logit (fp32) is below `tau`, or an exact tie, the verifier runs.
Repairs:

- `replay` (default): keep the request's history canonical, lazily. The
  verifier recomputes, in one pass, every position since the last canonical
  one (its kernels are row-independent, so the rows equal decoding alone
  bitwise), overwrites those K/V columns, checks the tokens emitted since then
  against the canonical argmax (a mismatch is a flip the gate missed: strict
  mode rolls back to it), and picks the current token from canonical logits.
  At the end a strict request replays its unverified tail the same way, so its
  output equals the reference exactly.
- `column` (the paper, §3.2): recompute the current step alone from the
  request's (drifted) cache; on disagreement emit the verifier's token and keep
  its K/V column. `column-always` keeps the column even when the tokens agree;
  `none` keeps the fast column (the §4.4 ablation).

`verify-all` is `margin` with tau = infinity and `column-always`.
"""
from __future__ import annotations

import math

import torch

from ..engine.policy import Policy, VerifyJob
from ..engine.sequence import Sequence
from .reference import parse_precision

REPAIRS = ("replay", "column", "column-always", "none")
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


class MarginPolicy(Policy):
    name = "margin"

    def __init__(self, tau: float = DEFAULT_TAU, repair: str = "replay", precision: str = "bf16",
                 strict: bool = True):
        self.tau = parse_tau(tau)
        if repair not in REPAIRS:
            raise ValueError(f"unknown repair mode {repair!r} (choose from {', '.join(REPAIRS)})")
        self.repair, self.strict = repair, strict
        self.precision, self.precision_name = parse_precision(precision), precision

    def settings(self) -> dict:
        return {"tau": self.tau if math.isfinite(self.tau) else "inf", "repair": self.repair,
                "verifier_precision": self.precision_name, "strict": self.strict}

    def propose(self, seq: Sequence, logits: torch.Tensor) -> VerifyJob | None:
        margin = margin_of(logits)
        seq.stats["min_margin"] = min(seq.stats["min_margin"], margin)
        if not (margin < self.tau or margin == 0.0):
            return None
        seq.stats["triggers"] += 1
        pos = seq.next_pos
        if self.repair == "replay":
            return VerifyJob(seq, seq.canonical_len, pos, self.precision)
        if self.repair != "column-always":
            seq.pending = seq.read_column(pos)  # the fast column, maybe restored
        return VerifyJob(seq, pos, pos, self.precision)

    def commit(self, seq: Sequence, logits: torch.Tensor, verified: torch.Tensor | None) -> None:
        fast_token = int(torch.argmax(logits))
        if verified is None:
            seq.output_ids.append(fast_token)
            return
        seq.stats["replayed_tokens"] += verified.shape[0]
        if self.repair == "replay":
            if self._check_history(seq, verified[:-1]):
                return  # rolled back to a missed flip; that step's token is already fixed
            seq.canonical_len = seq.next_pos + 1
        token = int(torch.argmax(verified[-1]))
        if token != fast_token:
            seq.stats["repairs"] += 1
        keep_column = self.repair in ("replay", "column-always") or (self.repair == "column" and token != fast_token)
        if not keep_column:
            seq.write_column(seq.next_pos, seq.pending)
        seq.pending = None
        seq.output_ids.append(token)

    def _check_history(self, seq: Sequence, rows: torch.Tensor) -> bool:
        """rows[i] are canonical logits at position canonical_len + i; the token after it was emitted
        on the fast path. Returns True if it rolled back to a mismatch."""
        start = seq.canonical_len
        for i, row in enumerate(rows):
            expected = int(torch.argmax(row))
            if expected != seq.token_at(start + i + 1):
                seq.stats["missed_flips"] = seq.stats.get("missed_flips", 0) + 1
                if not self.strict:
                    continue
                seq.stats["rollbacks"] += 1
                seq.rollback(start + i + 1)
                seq.canonical_len = start + i + 1
                seq.output_ids.append(expected)
                return True
        return False

    def finish_job(self, seq: Sequence) -> VerifyJob | None:
        last_written = seq.num_tokens - 2  # the final token was never fed back
        if self.repair != "replay" or not self.strict or seq.canonical_len > last_written:
            return None
        return VerifyJob(seq, seq.canonical_len, last_written, self.precision)

    def confirm_finish(self, seq: Sequence, verified: torch.Tensor) -> bool:
        seq.stats["replayed_tokens"] += verified.shape[0]
        if self._check_history(seq, verified):
            return False
        seq.canonical_len = seq.num_tokens - 1
        return True

    def releasable(self, seq: Sequence) -> int:
        if self.repair == "replay" and self.strict:
            return min(len(seq.output_ids), seq.canonical_len - seq.prompt_len + 1)  # verified tokens only
        return len(seq.output_ids)


class VerifyAllPolicy(MarginPolicy):
    name = "verify-all"

    def __init__(self, precision: str = "bf16", **_):
        super().__init__(tau=math.inf, repair="column-always", precision=precision)
