"""The token a row chooses (`choose`), and the scores it is the argmax of.

The options are `options/sampling.py`'s. A row's token is the argmax of its scores: the logits at
temperature 0, seeded Gumbel-max above it, so every policy (and the margin gate) works on scores
unchanged. The steps, in order, each a
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels import invariant
from ..options.sampling import SamplingParams

if TYPE_CHECKING:
    from .sequence import Sequence

_MASK = (1 << 63) - 1


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((seed * 0x9E3779B97F4A7C15) ^ position) & _MASK)
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)  # mt19937: the same everywhere
    return invariant.gumbel_from_uniform(u)


@dataclass(frozen=True, slots=True)
class Choice:
    """What rows of one request choose. Row i was fed the token at position `first_pos` + i; its
    choice, `tokens[i]`, is the token at `first_pos` + i + 1 (`positions[i]`)."""
    first_pos: int
    logits: torch.Tensor   # [n, vocab] fp32, as the forward returned them: what logprobs report
    scores: torch.Tensor   # [n, vocab] with the request's sampling applied: what the tokens are the argmax of
    tokens: list[int]

    @property
    def positions(self) -> range:
        """The positions of the chosen tokens."""
        return range(self.first_pos + 1, self.first_pos + 1 + len(self.tokens))

    def row(self, i: int) -> Choice:
        """Row i alone."""
        return Choice(self.first_pos + i, self.logits[i:i + 1], self.scores[i:i + 1], self.tokens[i:i + 1])


def choose(seq: Sequence, rows: torch.Tensor, first_pos: int, drafts: list[int] | tuple[int, ...] = ()) -> Choice:
    """The one place a row's token is chosen: `rows` (fp32 logits, [n, vocab]) were fed the tokens at
    positions first_pos, first_pos + 1, ... of `seq` (a decode step's first row: `seq.last_fed_pos`),
    followed by this step's `drafts` (speculation: not the sequence's tokens until accepted, yet row i's
    penalties see d1..di, as plain decoding after them would)."""
    history = [*seq.request.prompt_ids, *seq.output_ids, *drafts] if seq.request.sampling.adjusts else []
    scored = scores(seq, rows, first_pos + 1, history)
    return Choice(first_pos, rows, scored, scored.argmax(-1).tolist())


def scores(seq: Sequence, rows: torch.Tensor, first_chosen: int, history: list[int]) -> torch.Tensor:
    """`rows` (fp32, [n, vocab]) with the request's sampling applied; row i chooses the token at position
    first_chosen + i, after `history`[:first_chosen + i]."""
    sp = seq.request.sampling
    if sp.temperature == 0 and not sp.adjusts:
        return rows
    rows = rows.float()
    if sp.adjusts:
        rows = torch.stack([adjust(seq, row, first_chosen + i, history) for i, row in enumerate(rows)])
    if sp.temperature == 0:
        return rows
    rows = rows / sp.temperature
    if sp.filters:
        rows = filtered(rows, sp)
    noise = torch.stack([gumbel_noise(sp.seed, first_chosen + i, rows.shape[-1]).to(rows.device)
                         for i in range(rows.shape[0])])
    return rows + noise


def adjust(seq: Sequence, row: torch.Tensor, position: int, history: list[int]) -> torch.Tensor:
    """Bias and penalties for the row choosing the token at `position`, from the tokens before it."""
    sp, row = seq.request.sampling, row.clone()
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype)
    if sp.repetition_penalty != 1:  # prompt and output tokens before `position`
        seen = torch.unique(torch.tensor(history[:position], dtype=torch.long))
        x = row[seen]
        row[seen] = torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and position > seq.prompt_len:  # output tokens only
        output = torch.tensor(history[seq.prompt_len:position], dtype=torch.long)
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
