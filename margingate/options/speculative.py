"""`SpeculativeConfig`: how a request speculates, validated once. How proposals are made and checked is
`engine/speculative.py`'s."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OptionError

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
