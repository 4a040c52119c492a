"""Logprobs: log-softmax of fp32 logits rows, in the kernels' fixed per-row order.

A token's logprob is `row[token] - lse(row)`, with lse from csrc/logits.cpp (one thread per row,
no libm), so it is a function of the row's bits alone: the same in a prompt row, a decode row or
a verifier row, alone or batched, at any thread count. They are the model's distribution (the raw
logits, before bias, penalties, temperature and filters), as vLLM reports by default, which is
also what scoring a sequence computes. `top` lists the best alternatives, ties by token id.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import invariant


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), best first


def logprobs_of(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Row r's logprob of tokens[r], and its k best tokens."""
    rows = rows.reshape(-1, rows.shape[-1]).float()
    lse = invariant.logsumexp_rows(rows)
    picked = rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] - lse
    tops = [top_k(row, lse[r], k) for r, row in enumerate(rows)] if k else [()] * len(tokens)
    return [TokenLogprob(t, float(lp), top) for t, lp, top in zip(tokens, picked.tolist(), tops)]


def top_k(row: torch.Tensor, lse: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The k largest entries, ties by ascending token id (topk's own order is unspecified)."""
    kth = torch.topk(row, k).values[-1]
    ids = torch.nonzero(row >= kth).flatten()  # ascending ids
    best = ids[torch.sort(row[ids], descending=True, stable=True).indices[:k]]
    return tuple(zip(best.tolist(), (row[best] - lse).tolist()))
