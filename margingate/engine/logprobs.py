"""Logprobs: log-softmax of fp32 logits rows, in the kernels' fixed per-row order.

A token's logprob is `row[token] - lse(row)`, with lse from csrc/logits.cpp (one thread per row,
no libm), so it is a function of the row's bits alone: the same in a prompt row, a decode row or
a verifier row, alone or batched, at any thread count. They are the model's distribution (the raw
logits, before bias, penalties, temperature and filters), as vLLM reports by default, which is
also what scoring a sequence computes. `top` lists the best alternatives, ties by token id.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import invariant
from .device_rows import DeviceRows, host


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), best first


def logprobs_of(rows: torch.Tensor | DeviceRows, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Row r's logprob of tokens[r], and its k best tokens (rows left on the device are read back)."""
    rows = host(rows)
    rows = rows.reshape(-1, rows.shape[-1]).float()
    lse = invariant.logsumexp_rows(rows)
    picked = rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] - lse
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
