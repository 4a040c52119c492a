"""Speculative decoding that cannot change a token: proposals checked by the invariant kernels.

A proposer guesses the next k tokens of a request. The engine feeds [last token, d1..dk] as one
span of the step's forward, through the invariant kernels with exact attention: each row's
logits are bitwise the logits of decoding that position alone (the kernels are row-independent),
so row i chooses, with the request's own sampling (seeded Gumbel noise keyed by position), the
token that plain decoding would choose after d1..di. The engine accepts drafts while they equal
those choices and emits the first choice that differs: the output is the plain output, fewer
passes over the weights.

It applies to requests whose plain decode rows are already canonical (`batch-invariant`, bf16
`reference`) and to `fast` (which promises nothing either way). A verifying policy decodes on the
fast path and repairs later; its requests decode without speculation, and the report says so.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import OptionError
from .sampling import scores
from .sequence import Sequence

MAX_SPECULATIVE_TOKENS = 16   # past this a pass is compute-bound on every CPU we measured
METHODS = ("ngram", "draft")


class SpeculativeError(OptionError):
    """A bad speculative option; `option` names the field."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a request speculates: `method`, and up to `num_tokens` proposals per step. `ngram`
    matches the last n tokens (n from `ngram_max` down to `ngram_min`) against the request's
    earlier tokens (prompt and output) and proposes what followed the latest match; `draft` asks
    the engine's draft model (`draft.py`)."""
    method: str = "ngram"
    num_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculativeError("method", f"unknown speculative method {self.method!r} "
                                             f"(choose from {', '.join(METHODS)})")
        for option, low, high in (("num_tokens", 1, MAX_SPECULATIVE_TOKENS), ("ngram_max", 1, 16),
                                  ("ngram_min", 1, 16)):
            value = getattr(self, option)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise SpeculativeError(option, f"{option} must be an integer in [{low}, {high}], got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise SpeculativeError("ngram_min", f"ngram_min ({self.ngram_min}) must be <= ngram_max "
                                                f"({self.ngram_max})")

    def check(self, draft) -> None:
        """Can an engine whose draft model is `draft` (None: none loaded) serve this?"""
        if self.method == "draft" and draft is None:
            raise SpeculativeError("method", "speculative method 'draft' needs a draft model: load one with "
                                             "--draft-model (LLM(draft_model=...))")

    def proposer(self, draft=None) -> Proposer:
        """This request's proposer; `draft` is the engine's `DraftModel`."""
        self.check(draft)
        return NgramProposer(self.ngram_max, self.ngram_min) if self.method == "ngram" else draft.proposer()


class Proposer:
    """Guesses a request's next tokens. A third proposer implements `propose` and is named in
    `METHODS` / `SpeculativeConfig.proposer`; exactness never depends on its guesses."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k guesses of the tokens after `tokens` (the request's prompt and output so far)."""
        raise NotImplementedError

    def close(self) -> None:
        """The request is done: free what it held."""


class NgramProposer(Proposer):
    """Prompt lookup: no second model, pays on outputs that copy their input (edits, summaries, code)."""

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # the latest earlier match first
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []


@dataclass
class SpeculationStats:
    """One request's speculation, for its report and /metrics."""
    steps: int = 0          # decode steps that carried proposals
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0    # spent proposing
    held: int = 0           # steps the cost model fed no proposals (step_profile.py: they would not pay)
    off: str | None = None  # why this request decodes without speculation

    @property
    def rate(self) -> float:
        """The acceptance rate so far, starting from an even guess (1 of 2)."""
        return (self.accepted + 1) / (self.proposed + 2)

    @property
    def seconds_per_proposal(self) -> float:
        return self.seconds / self.proposed if self.proposed else 0.0

    def report(self) -> dict:
        if self.off:
            return {"speculation": "off", "speculation_off_reason": self.off}
        return {"speculative_steps": self.steps, "proposed_tokens": self.proposed, "accepted_tokens": self.accepted,
                "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
                "mean_accepted_length": round(self.accepted / self.steps, 3) if self.steps else None,
                "proposal_seconds": round(self.seconds, 6), "speculation_held_steps": self.held}


def off_reason(policy) -> str | None:
    """Why a request under `policy` decodes without speculation (None: it speculates)."""
    if policy.verifies:
        return (f"policy {policy.name} decodes on the fast path and verifies later; its requests decode "
                f"without speculation")
    if policy.deterministic and not policy.exact_attention:
        return f"policy {policy.name} recomputes every step in the verifier"
    return None


def propose(seq: Sequence, k: int) -> int:
    """Append up to k of the proposer's guesses to `seq` (the step's forward feeds them); their count."""
    stats = seq.speculation
    t = time.perf_counter()
    drafts = seq.proposer.propose(seq.tokens(0, seq.num_tokens), k)
    stats.seconds += time.perf_counter() - t
    seq.output_ids += drafts
    seq.drafted = len(drafts)
    return len(drafts)


def accept(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """The step's rows for [last token, d1..dm] came back: keep the drafts while they are what the
    request's sampling chooses at their position, then the first choice that differs (or the one
    after the last draft). Returns the rows whose choices were kept."""
    m, stats = seq.drafted, seq.speculation
    base = seq.num_tokens - m   # the position d1 takes
    drafts = seq.output_ids[base - seq.prompt_len:]
    chosen = scores(seq, logits, base).argmax(-1).tolist()  # row i: penalties see d1..di, as plain decoding
    keep = []
    for i, token in enumerate(chosen):
        keep.append(token)
        stop = token in seq.stop_ids and not seq.request.ignore_eos
        if i == m or token != drafts[i] or stop:
            break
    del seq.output_ids[base - seq.prompt_len:]
    seq.output_ids += keep
    seq.drafted = 0
    accepted = sum(1 for a, b in zip(keep, drafts) if a == b)
    stats.steps, stats.proposed, stats.accepted = stats.steps + 1, stats.proposed + m, stats.accepted + accepted
    return logits[:len(keep)]
