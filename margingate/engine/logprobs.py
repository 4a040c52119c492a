"""Logprobs: log-softmax of fp32 logits rows, in the kernels' fixed per-row order.

A token's logprob is `row[token] - lse(row)`, with lse from csrc/logits.cpp (one thread per row,
no libm), so it is a function of the row's bits alone: the same in a prompt row, a decode row or
a verifier row, alone or batched, at any thread count. They are the model's distribution (the raw
logits, before bias, penalties, temperature and filters), as vLLM reports by default, which is
also what scoring a sequence computes. `top` lists the best alternatives, ties by token id.

`token_logprobs` is the one definition, raw or processed (after temperature and filters, as the
sampler applies them), for the engine's reports and for a trainer's loss alike: differentiable, its
backward the plain-torch log-softmax's in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import invariant
from ..options.sampling import SamplingParams
from .device_rows import DeviceRows, host
from .sampling import tempered


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), best first


LOGPROBS_MODES = ("raw", "processed")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, mode: str = "raw", *, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The logprob of tokens[...] under the row logits[..., :] (fp32): "raw", the model's log-softmax, or
    "processed", that of the distribution a row samples from at `temperature` after the filters
    (`sampling.tempered`). The same bits as the engine reports for the same row, whatever the batch; autograd
    flows into `logits`."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {list(logits.shape)} and tokens {list(tokens.shape)}: one row per token needed")
    rows = logits.reshape(-1, logits.shape[-1]).float()
    if mode == "processed" and temperature > 0:  # at temperature 0 a row's distribution is its logits
        rows = tempered(rows, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    return _LogSoftmaxAt.apply(rows, tokens.reshape(-1).long()).reshape(tokens.shape)


class _LogSoftmaxAt(torch.autograd.Function):
    """row[token] - lse(row), lse in the kernels' fixed order; backward: onehot - softmax, in fp32."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        lse = invariant.logsumexp_rows(rows)
        ctx.save_for_backward(rows, tokens, lse)
        return _at(rows, tokens, lse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, tokens, lse = ctx.saved_tensors
        out = -torch.exp(rows.float() - lse[:, None]) * grad[:, None]
        out[torch.arange(rows.shape[0]), tokens] += grad
        return out, None


def _at(rows: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """row[token] - lse(row): a token's logprob, the one formula."""
    return rows[torch.arange(rows.shape[0]), tokens] - lse


def logprobs_of(rows: torch.Tensor | DeviceRows, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Row r's logprob of tokens[r] (`token_logprobs`'s formula, of the rows as given: the raw logits or the
    processed distribution), and its k best tokens (rows left on the device are read back)."""
    rows = host(rows)
    rows = rows.reshape(-1, rows.shape[-1]).float()
    lse = invariant.logsumexp_rows(rows)  # once, for the picked tokens and the alternatives
    picked = _at(rows, torch.tensor(tokens, dtype=torch.long), lse)
    tops = top_k(rows, lse, k) if k and len(tokens) else [()] * len(tokens)
    return [TokenLogprob(t, float(lp), top) for t, lp, top in zip(tokens, picked.tolist(), tops)]


def top_k(rows: torch.Tensor, lse: torch.Tensor, k: int) -> list[tuple[tuple[int, float], ...]]:
    """Each row's k largest entries, ties by ascending token id (topk's own order is unspecified).
    The k-th value is tied iff the (k+1)-th equals it; otherwise topk's set is exact."""
    best = torch.topk(rows, min(k + 1, rows.shape[1]), dim=1)
    ids = best.indices[:, :k].sort(dim=1).values  # ascending ids
    tied = (best.values[:, k - 1] == best.values[:, k]) if best.values.shape[1] > k else torch.zeros(0)
    for r in torch.nonzero(tied).flatten().tolist():  # the k-th value is shared: the lowest ids
        ids[r] = _tied(rows[r], rows[r] >= best.values[r, k - 1], k)
    vals = rows.gather(1, ids)
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices
    ids, vals = ids.gather(1, order), vals.gather(1, order) - lse[:, None]
    # a token the processed distribution removed (the grammar's mask, a filter) is no alternative
    return [tuple((t, x) for t, x in zip(i, v) if x > -math.inf) for i, v in zip(ids.tolist(), vals.tolist())]


def _tied(row: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """The k best ids of a row whose k-th value is shared: by value, then by ascending id."""
    ids = torch.nonzero(mask).flatten()
    return ids[torch.sort(row[ids], descending=True, stable=True).indices[:k]].sort().values
