"""Who guesses a request's next tokens (`Proposer`: n-gram lookup here, a draft model in `draft.py`), and
what its speculation did (`SpeculationStats`). Exactness never depends on a proposer: `speculative.py`
keeps only the drafts that the request's own rows choose."""
from __future__ import annotations

from dataclasses import dataclass

from ..options.speculative import SpeculativeConfig


def proposer_for(config: SpeculativeConfig, draft=None) -> Proposer:
    """A request's proposer; `draft` is the engine's `DraftModel` (None: none loaded)."""
    config.check(draft)
    return NgramProposer(config.ngram_max, config.ngram_min) if config.method == "ngram" else draft.proposer()


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
