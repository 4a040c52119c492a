"""`SamplingParams`: how one request chooses its tokens, validated once (the CLI, `LLM.generate` and the HTTP
protocol all build one). What the options do to the logits is `engine/sampling.py`'s."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from ..errors import OptionError
from .structured import StructuredOutput

INT64 = 1 << 63
MAX_LOGPROBS = 20


class SamplingError(OptionError):
    """A bad sampling option; `option` names the SamplingParams field."""


def _number(option: str, value, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or value > high or (low_open and value == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise SamplingError(option, f"{option} must be a number in {bound}, got {value!r}")
    return float(value)


def _count(option: str, value, high: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high):
        raise SamplingError(option, f"{option} must be an integer in [0, {high}], got {value!r}")


def _stop_strings(value) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else tuple(value or ()) if isinstance(value, (list, tuple)) else None
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise SamplingError("stop", f"stop must be a non-empty string or a list of them, got {value!r}")
    return stops


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens, and which logprobs it wants back. Validated here, once:
    the CLI, `LLM.generate` and the HTTP protocol all build one."""
    temperature: float = 0.0          # 0: greedy; > 0: Gumbel-max keyed by `seed`
    seed: int | None = None           # None with temperature > 0: a random one (reported)
    top_p: float = 1.0
    top_k: int = 0                    # 0 (or -1): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None       # each output token's logprob and its top `logprobs` alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo scoring)
    stop: tuple[str, ...] = ()        # stop strings: the output ends with the token completing one (detokenize.py)
    structured: StructuredOutput | None = None  # what the output must match (engine/structured.py)
    # logprobs of the model's distribution ("raw") or of the one the row samples from ("processed": after
    # bias, penalties, the grammar's mask, temperature and filters); None: processed when constrained
    logprobs_mode: str | None = None
    min_tokens: int = 0               # the stop tokens cannot be chosen before this many output tokens (vLLM's)

    def __post_init__(self):
        _number("temperature", self.temperature, 0.0, 2.0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -INT64 <= self.seed < INT64):
            raise SamplingError("seed", f"seed must be a 64-bit integer, got {self.seed!r}")
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingError("top_k", f"top_k must be an integer >= 0 (0 or -1: off), got {self.top_k!r}")
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        bias = {}
        for token, value in dict(self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingError("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            bias[token] = _number("logit_bias", value, -100.0, 100.0)
        object.__setattr__(self, "logit_bias", bias)
        _count("logprobs", self.logprobs, MAX_LOGPROBS)
        _count("prompt_logprobs", self.prompt_logprobs, MAX_LOGPROBS)
        _count("min_tokens", self.min_tokens, 1 << 30)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingError("structured", f"structured must be a StructuredOutput, got {self.structured!r}")
        if self.logprobs_mode not in (None, "raw", "processed"):
            raise SamplingError("logprobs_mode", f"logprobs_mode must be raw or processed, got {self.logprobs_mode!r}")

    def seeded(self) -> SamplingParams:
        """With a seed drawn now when sampling has none (sampling still works, unreproducibly)."""
        if self.temperature > 0 and self.seed is None:
            return replace(self, seed=int.from_bytes(os.urandom(7), "little"))
        return self

    def for_sample(self, index: int) -> SamplingParams:
        """Sample `index` of n: seed + index (wrapped to 64 bits), so it is the single request with that seed."""
        if self.seed is None:
            return self
        return replace(self, seed=(self.seed + index + INT64) % (2 * INT64) - INT64)

    def check_vocab(self, vocab: int) -> None:
        bad = [t for t in self.logit_bias if t >= vocab]
        if bad:
            raise SamplingError("logit_bias", f"logit_bias names token id {bad[0]}, outside the vocabulary "
                                              f"(ids 0..{vocab - 1})")

    @property
    def adjusts(self) -> bool:
        """Are the logits changed before the choice (bias, penalties, min_tokens)?"""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1 or self.min_tokens > 0

    @property
    def processed_logprobs(self) -> bool:
        return self.logprobs_mode == "processed" or (self.logprobs_mode is None and self.structured is not None)

    @property
    def filters(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)
