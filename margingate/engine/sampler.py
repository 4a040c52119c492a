"""Scores the policies choose from: logits at temperature 0, seeded Gumbel-max above it.

Sampling with Gumbel-max is an argmax over perturbed scores, so every policy
(and the margin gate) works on scores unchanged. The noise is keyed by the
request's seed and the position of the token being chosen, never by batch or
step, so a seeded sample is as reproducible as a greedy one.
"""
from __future__ import annotations

import torch

from .sequence import Sequence

_MASK = (1 << 63) - 1


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(((seed * 0x9E3779B97F4A7C15) ^ position) & _MASK)
    u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
    return (-torch.log(-torch.log(u))).float()


def scores(seq: Sequence, logits: torch.Tensor, first_position: int) -> torch.Tensor:
    """Rows of `logits` choose the tokens at positions first_position, first_position + 1, ..."""
    req = seq.request
    if req.temperature == 0:
        return logits
    rows = logits.reshape(-1, logits.shape[-1]) / req.temperature
    noise = torch.stack([gumbel_noise(req.seed, first_position + i, rows.shape[-1]).to(rows.device)
                         for i in range(rows.shape[0])])
    return (rows + noise).reshape(logits.shape)
