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

import torch

from ..engine.policy import Policy, VerifyJob
from ..engine.sequence import Sequence
from .reference import parse_precision

REPAIRS = ("replay", "column", "column-always", "none")


class VerifyingPolicy(Policy):
    name = "verifying"
    #: pad each replay job to this many rows (a fixed verifier shape, as LLM-42 does)
    pad_to: int | None = None

    #: testing aid (LLM-42's skip-mismatch): emit the fast top-2 instead of top-1 once, at this
    #: output index and without triggering, so that the repair has a real missed flip to find
    inject_flip_at: int | None = None

    def __init__(self, repair: str = "replay", precision: str = "bf16", strict: bool = True):
        if repair not in REPAIRS:
            raise ValueError(f"unknown repair mode {repair!r} (choose from {', '.join(REPAIRS)})")
        self.repair, self.strict = repair, strict
        self.precision, self.precision_name = parse_precision(precision), precision

    def settings(self) -> dict:
        return {"repair": self.repair, "verifier_precision": self.precision_name, "strict": self.strict}

    def gate(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Verify this step?"""
        raise NotImplementedError

    def injecting(self, seq: Sequence) -> bool:
        return self.inject_flip_at == len(seq.output_ids) and not seq.stats.get("injected")

    def propose(self, seq: Sequence, logits: torch.Tensor) -> VerifyJob | None:
        if self.injecting(seq):
            return None
        if not self.gate(seq, logits):
            return None
        seq.stats["triggers"] += 1
        return self.job(seq)

    def job(self, seq: Sequence) -> VerifyJob:
        """Verify this step's token (with `replay`, everything since the last canonical position)."""
        pos = seq.next_pos
        if self.repair == "replay":
            return VerifyJob(seq, seq.canonical_len, pos, self.precision, self.pad_to)
        if self.repair != "column-always":
            seq.pending = seq.read_column(pos)  # the fast column, maybe restored
        return VerifyJob(seq, pos, pos, self.precision)

    def commit(self, seq: Sequence, logits: torch.Tensor, verified: torch.Tensor | None) -> None:
        fast_token = int(torch.argmax(logits))
        if verified is None:
            if self.injecting(seq):
                seq.stats["injected"] = 1
                fast_token = int(torch.topk(logits, 2).indices[1])
            seq.output_ids.append(fast_token)
            return
        seq.stats["replayed_tokens"] += verified.shape[0]
        if self.repair == "replay":
            if self._check_history(seq, verified[:-1]):
                return  # rolled back to a flip; that step's token is already fixed
            seq.canonical_len = seq.next_pos + 1
            seq.flagged.clear()
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
                if start + i + 1 in seq.flagged:  # the gate saw it; its check was deferred
                    seq.stats["repairs"] += 1
                else:
                    seq.stats["missed_flips"] = seq.stats.get("missed_flips", 0) + 1
                if not self.strict:
                    continue
                seq.stats["rollbacks"] += 1
                seq.stats["discarded_tokens"] = (seq.stats.get("discarded_tokens", 0)
                                                 + seq.num_tokens - (start + i + 1))
                seq.rollback(start + i + 1)
                seq.canonical_len = start + i + 1
                seq.flagged.clear()
                seq.output_ids.append(expected)
                return True
        return False

    def finish_job(self, seq: Sequence) -> VerifyJob | None:
        last_written = seq.num_tokens - 2  # the final token was never fed back
        if self.repair != "replay" or not self.strict or seq.canonical_len > last_written:
            return None
        return VerifyJob(seq, seq.canonical_len, last_written, self.precision, self.pad_to)

    def confirm_finish(self, seq: Sequence, verified: torch.Tensor) -> bool:
        seq.stats["replayed_tokens"] += verified.shape[0]
        if self._check_history(seq, verified):
            return False
        seq.canonical_len = seq.num_tokens - 1
        seq.flagged.clear()
        return True

    def releasable(self, seq: Sequence) -> int:
        if self.repair == "replay" and self.strict:
            return min(len(seq.output_ids), seq.canonical_len - seq.prompt_len + 1)  # verified tokens only
        return len(seq.output_ids)
