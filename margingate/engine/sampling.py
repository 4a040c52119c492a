"""Sampling options and the scores the policies choose from.

A policy takes the argmax of `scores`: the logits at temperature 0, seeded Gumbel-max above it,
so every policy (and the margin gate) works on scores unchanged. The steps, in order, each a
function of the request alone (its options, its own history, the row's position):

1. `logit_bias` is added; penalties from the request's own tokens before the row's position:
   `repetition_penalty` (prompt and output, as vLLM: positive logits divided, negative multiplied),
   `frequency_penalty` x count and `presence_penalty` (output tokens, as OpenAI);
2. temperature 0: the argmax of that (ties: the lowest token id, as torch.argmax);
3. otherwise / temperature, then the filters, ties always broken by token id: `top_k` keeps the k
   best, `top_p` the shortest best-first run whose probability reaches p (a sequential fp64 sum in
   that order), `min_p` the tokens with probability >= min_p x the top one's; then + Gumbel noise
   keyed by (seed, position), never by batch or step.

Probabilities use the kernels' own exp and the noise their own log (csrc/logits.cpp), so no bit
depends on a math library or on which of torch's ISA kernels runs.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import OptionError
from ..kernels import invariant

if TYPE_CHECKING:
    from .sequence import Sequence

_MASK = (1 << 63) - 1
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
    stop: tuple[str, ...] = ()        # stop strings: the output ends with the token completing one (stops.py)

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
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "stop", _stop_strings(self.stop))

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
        """Are the logits changed before the choice (bias, penalties)?"""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1

    @property
    def filters(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((seed * 0x9E3779B97F4A7C15) ^ position) & _MASK)
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)  # mt19937: the same everywhere
    return invariant.gumbel_from_uniform(u)


def scores(seq: Sequence, logits: torch.Tensor, first_position: int) -> torch.Tensor:
    """Rows of `logits` (fp32) choose the tokens at positions first_position, first_position + 1, ..."""
    sp = seq.request.sampling
    if sp.temperature == 0 and not sp.adjusts:
        return logits
    rows = logits.reshape(-1, logits.shape[-1]).float()
    if sp.adjusts:
        rows = torch.stack([adjust(seq, row, first_position + i) for i, row in enumerate(rows)])
    if sp.temperature == 0:
        return rows.reshape(logits.shape)
    rows = rows / sp.temperature
    if sp.filters:
        rows = filtered(rows, sp)
    noise = torch.stack([gumbel_noise(sp.seed, first_position + i, rows.shape[-1]).to(rows.device)
                         for i in range(rows.shape[0])])
    return (rows + noise).reshape(logits.shape)


def adjust(seq: Sequence, row: torch.Tensor, position: int) -> torch.Tensor:
    """Bias and penalties for the row choosing the token at `position`, from the tokens before it."""
    sp, row = seq.request.sampling, row.clone()
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype)
    if sp.repetition_penalty != 1:  # prompt and output tokens before `position`
        seen = torch.unique(torch.tensor(seq.tokens(0, position), dtype=torch.long))
        x = row[seen]
        row[seen] = torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and position > seq.prompt_len:  # output tokens only
        output = torch.tensor(seq.tokens(seq.prompt_len, position), dtype=torch.long)
        counts = torch.bincount(output, minlength=row.shape[0]).to(row.dtype)
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)
    return row


def filtered(rows: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """top_k, top_p, min_p: the tokens each removes get -inf (Gumbel-max never picks them)."""
    out = []
    for row in rows:
        drop = torch.zeros_like(row, dtype=torch.bool)
        if sp.top_k > 0 or sp.top_p < 1:  # min_p alone needs no order
            order = torch.sort(row, descending=True, stable=True).indices  # ties: ascending token id
        if sp.top_k > 0:
            drop[order[sp.top_k:]] = True
        row = row.masked_fill(drop, -math.inf)
        if sp.top_p < 1 or sp.min_p > 0:
            e = invariant.exp_shifted(row[None], row.max()[None])[0]  # probability / top probability
            if sp.top_p < 1:
                cum = np.cumsum(e[order].numpy().astype(np.float64))  # sequential, best first
                keep = int(np.searchsorted(cum, sp.top_p * cum[-1])) + 1
                drop[order[keep:]] = True
            if sp.min_p > 0:
                drop |= e.double() < sp.min_p
        out.append(row.masked_fill(drop, -math.inf))
    return torch.stack(out)
