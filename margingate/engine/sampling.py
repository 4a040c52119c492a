"""The token a row chooses (`choose`), and the scores it is the argmax of.

The options are `options/sampling.py`'s. A row's token is the argmax of its scores: the logits at
temperature 0, seeded Gumbel-max above it, so every policy (and the margin gate) works on scores
unchanged. The steps, in order, each a
function of the request alone (its options, its own history, the row's position):

1. `logit_bias` is added; penalties from the request's own tokens before the row's position:
   `repetition_penalty` (prompt and output, as vLLM: positive logits divided, negative multiplied),
   `frequency_penalty` x count and `presence_penalty` (output tokens, as OpenAI); before the
   `min_tokens`-th output token the stop tokens get -inf (vLLM's min_tokens);
2. temperature 0: the argmax of that (ties: the lowest token id, as torch.argmax; our own kernel);
3. otherwise / temperature, then the filters, ties always broken by token id: `top_k` keeps the k
   best, `top_p` the shortest best-first run whose probability reaches p (a sequential fp64 sum in
   that order against p x the row's total in the kernels' fixed order), `min_p` the tokens with
   probability >= min_p x the top one's; then + Gumbel noise -log(-log(u)), u from our own
   Philox4x32-10 keyed by (seed, position, token id), never by batch, step or library version.

A structured-output request's grammar mask (structured.py) comes between 1 and 2. Probabilities use
the kernels' own exp and the noise their own generator and log (csrc/logits.cpp), so no bit depends
on a math library, on which of torch's ISA kernels runs, or on torch's version.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels import invariant
from ..options.sampling import SamplingParams
from .device_rows import DeviceRows
from .structured import masked

if TYPE_CHECKING:
    from .sequence import Sequence

@dataclass(frozen=True, slots=True)
class RowChoices:
    """What rows of one request choose. Row i was fed the token at position `first_pos` + i; its
    choice, `tokens[i]`, is the token at `first_pos` + i + 1 (`positions[i]`)."""
    first_pos: int
    logits: torch.Tensor | DeviceRows  # [n, vocab] fp32, as the forward returned them: what logprobs report
    scores: torch.Tensor | DeviceRows  # [n, vocab] with the request's sampling applied: the tokens' argmax
    tokens: list[int]
    processed: torch.Tensor | DeviceRows | None = None  # `scores` less the noise: what "processed" logprobs report

    @property
    def positions(self) -> range:
        """The positions of the chosen tokens."""
        return range(self.first_pos + 1, self.first_pos + 1 + len(self.tokens))

    def row(self, i: int) -> RowChoices:
        """Row i alone."""
        return RowChoices(self.first_pos + i, self.logits[i:i + 1], self.scores[i:i + 1], self.tokens[i:i + 1],
                      None if self.processed is None else self.processed[i:i + 1])


def choose(seq: Sequence, rows: torch.Tensor, first_pos: int, drafts: list[int] | tuple[int, ...] = ()) -> RowChoices:
    """The one place a row's token is chosen: `rows` (fp32 logits, [n, vocab]) were fed the tokens at
    positions first_pos, first_pos + 1, ... of `seq` (a decode step's first row: `seq.last_fed_pos`),
    followed by this step's `drafts` (speculation: not the sequence's tokens until accepted, yet row i's
    penalties see d1..di, as plain decoding after them would). Rows left on the device (`DeviceRows`) choose
    from their read-back argmax when the request is plain greedy; otherwise they are read back here."""
    if isinstance(rows, DeviceRows):
        if plain_greedy(seq):
            return RowChoices(first_pos, rows, rows, list(rows.best), rows)
        rows = rows.cpu()
    history = [*seq.request.prompt_ids, *seq.output_ids, *drafts] if seq.request.sampling.adjusts else []
    dist = processed(seq, rows, first_pos + 1, history)
    scored = dist
    if seq.request.sampling.temperature > 0:
        scored = invariant.add_gumbel_(dist.clone(), seq.request.sampling.seed, first_pos + 1)
    return RowChoices(first_pos, rows, scored, invariant.argmax_rows(scored), dist)


def plain_greedy(seq: Sequence) -> bool:
    """Does the request choose the argmax of the raw logits (temperature 0, no bias, penalty or grammar)?"""
    sp = seq.request.sampling
    return sp.temperature == 0 and not sp.adjusts and seq.grammar is None


def processed(seq: Sequence, rows: torch.Tensor, first_chosen: int, history: list[int]) -> torch.Tensor:
    """The distribution `rows` (fp32, [n, vocab]) sample from; row i chooses the token at position
    first_chosen + i, after `history`[:first_chosen + i]: bias, penalties, the grammar's mask,
    temperature, filters (steps 1-3 less the noise)."""
    if plain_greedy(seq):
        return rows
    sp = seq.request.sampling
    rows = rows.float()
    if sp.adjusts:
        rows = torch.stack([adjust(seq, row, first_chosen + i, history) for i, row in enumerate(rows)])
    if seq.grammar is not None:
        rows = masked(seq, rows, first_chosen)
    return tempered(rows, sp) if sp.temperature > 0 else rows


def tempered(rows: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Step 3 less the noise: rows / temperature, then the filters' -inf. The one statement of the
    distribution a sampled row draws from, which "processed" logprobs report and a trainer's loss reads
    (`logprobs.token_logprobs`): differentiable in `rows`, the filters chosen from its values alone."""
    rows = (rows / sp.temperature).contiguous()
    if not sp.filters:
        return rows
    if not rows.requires_grad:
        return filtered(rows, sp)
    removed = torch.isneginf(filtered(rows.detach(), sp)) & ~torch.isneginf(rows.detach())
    return rows.masked_fill(removed, -math.inf)


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
    if position - seq.prompt_len < sp.min_tokens:  # the row chooses output token number position - prompt_len
        row[[t for t in seq.stop_ids if t < row.shape[0]]] = -torch.inf
    return row


def best_first(row: torch.Tensor, k: int) -> torch.Tensor:
    """The row's first k token ids or more in best-first order (value descending, ties by ascending
    id): every token whose value reaches the k-th best one, ordered. A partial order: top_k and
    top_p read only the head of the vocabulary."""
    kth = torch.topk(row, min(k, row.numel()), sorted=False).values.min()
    ids = torch.nonzero(row >= kth if kth > -math.inf else row > kth).squeeze(1)  # ascending ids; never -inf
    return ids[torch.sort(row[ids], descending=True, stable=True).indices]


def nucleus(row: torch.Tensor, p: float, e: torch.Tensor, total: float) -> torch.Tensor:
    """top_p's token ids: the shortest best-first run whose probabilities (`e` = probability / top
    probability) reach p x `total`, summed sequentially in fp64 in that order. Only the head is sorted:
    the tokens whose e reaches a power of two below which less than (1 - p) of the mass lies (found
    from per-octave masses; they only choose the head, the sequential sum decides)."""
    target = p * total
    octave = (1 - torch.frexp(e).exponent.long()).clamp_(0, 159).masked_fill_(e == 0, 160)  # e in [2^-o, 2^(1-o))
    mass = torch.bincount(octave, weights=e.double(), minlength=161).cumsum(0)
    reach = int(torch.searchsorted(mass, target * (1 + 1e-6)).clamp_(max=159))
    ids = torch.nonzero(e >= 2.0 ** -reach).squeeze(1)  # a best-first prefix: e is monotone in the row
    head = ids[torch.sort(row[ids], descending=True, stable=True).indices]
    cum = np.cumsum(e[head].numpy().astype(np.float64))
    if cum[-1] < target:  # the octaves' unordered sum fell short by a rounding: take the whole order
        head = best_first(row, row.numel())
        cum = np.cumsum(e[head].numpy().astype(np.float64))
    return head[:min(int(np.searchsorted(cum, target)) + 1, len(head))]


def filtered(rows: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """top_k, top_p, min_p: the tokens each removes get -inf (Gumbel-max never picks them)."""
    out = []
    for row in rows:
        if sp.top_k > 0:
            keep = torch.zeros_like(row, dtype=torch.bool)
            keep[best_first(row, sp.top_k)[:sp.top_k]] = True
            row = row.masked_fill(~keep, -math.inf)
        if sp.top_p < 1 or sp.min_p > 0:
            e = invariant.exp_shifted(row[None], row.max()[None])[0]  # probability / top probability
            drop = e.double() < sp.min_p if sp.min_p > 0 else torch.zeros_like(row, dtype=torch.bool)
            if sp.top_p < 1:  # the total in the kernels' fixed order (csrc/logits.cpp), of the same exp
                keep = torch.zeros_like(drop)
                keep[nucleus(row, sp.top_p, e, float(invariant.sum_exp_rows(row[None])[0]))] = True
                drop |= ~keep
            row = row.masked_fill(drop, -math.inf)
        out.append(row)
    return torch.stack(out)
