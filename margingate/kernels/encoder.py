"""An encoder's numerics (BERT, nomic-bert) and an embedding's pooling, each composed of the invariant
kernels (`invariant.py`, orders in csrc/contract.h) and of elementwise IEEE operations (+, -, *, /, sqrt,
each rounded once wherever an element lies in a tensor): so a token's hidden state and a text's vector are
a function of the text alone, never of the batch around it or the thread count.

- Every reduction is one of the contract's: a row's mean and its sum of squares are the linear's dot
  product against a row of ones (contract 1: blocks of 32 k, ascending); RMSNorm's sum of squares
  (contract 2); attention (contract 3); exp is the contract's `exp8` (`invariant.exp_shifted`).
- Bidirectional attention is the engine's attention kernel with every query row of a text seeing all of its
  text's keys: keys in position order 0, 1, ..., L - 1, in chunks of 32 counted from position 0, each
  chunk's online-softmax partial merged in ascending order (docs/contract.md, "Embeddings").
- Pooling sums a text's token rows one at a time in position order (`pooled_sum`), never a library
  reduction whose split depends on the batch.
"""
from __future__ import annotations

import functools

import torch

from . import invariant
from .packing import PackedWeight, pack


@functools.cache
def _ones(k: int) -> PackedWeight:
    """A packed row of k ones: the linear's dot product with it is a row's sum in the contract's order."""
    return pack(torch.ones(1, k))


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Each fp32 row's sum [M, 1], in contract 1's order (the ones are exact in bf16, products exact)."""
    return invariant.linear(x.float(), _ones(x.shape[-1]))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """PyTorch's LayerNorm (biased variance, fp32 statistics, one rounding to x's dtype at the end):
    mean = sum / d (`row_sums`), then RMSNorm of the centred row (its weight, bf16, times x / sqrt(mean
    square + eps)), plus the fp32 bias."""
    h = x.float()
    centred = h - row_sums(h) / h.shape[-1]
    y = invariant.rmsnorm(centred, weight, eps)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def exp(x: torch.Tensor) -> torch.Tensor:
    """The contract's exp of every fp32 element (csrc/contract.h `exp8`; no libm)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    return invariant.exp_shifted(rows, torch.zeros(rows.shape[0])).reshape(x.shape)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU, x * Phi(x) (BERT's `gelu`, erf form), in fp32, rounded once to x's dtype, every element by
    the same fp32 steps, each rounded once (csrc/rowwise.cpp, `gelu_erf8`): z = |x| * fp32(1 / sqrt 2),
    t = 1 / (z * 0.5 + 1), erfc(z) / 2 = exp(P(t) - z * z) * t * 0.5 with the contract's exp and P Numerical
    Recipes' Chebyshev fit of erfc (relative error < 1.2e-7 everywhere, so GELU keeps fp32's precision in its
    tail, where 1 + erf cancels) by Horner; Phi = 1 - erfc(z) / 2 for x >= 0, else erfc(z) / 2; then Phi * x.
    tests/test_encoder_gelu.py holds it to the same steps as torch operations, bit for bit."""
    return invariant.gelu_erf(x)


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                            scale: float) -> torch.Tensor:
    """Each text's rows attend over all of that text's keys. q, k, v [N, heads, D]: the texts' rows one
    after another (lengths, in order). The engine's kernel over a cache of one-position blocks that *are*
    k and v (no copy): text i's block table lists its own rows, so a row's keys and their order are its
    text's, whatever else the call holds."""
    n, dev = q.shape[0], q.device
    width = max(lengths)
    tables = torch.full((len(lengths), width), -1, dtype=torch.long, device=dev)
    starts = [0]
    for i, length in enumerate(lengths):
        tables[i, :length] = torch.arange(starts[-1], starts[-1] + length)
        starts.append(starts[-1] + length)
    table_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    row_lengths = torch.tensor(lengths, dtype=torch.long).repeat_interleave(torch.tensor(lengths))
    empty = torch.empty(0)
    cache = (k.contiguous().unsqueeze(2), v.contiguous().unsqueeze(2), empty, empty)  # [N, heads, 1, D]
    assert starts[-1] == n, "lengths must cover the rows"
    return invariant.attention(q, cache, tables, table_of, row_lengths, scale)


def pooled_sum(h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[texts, d] fp32: each text's rows (h's rows, text after text) summed per column in contract 1's
    order over the text's positions (`row_sums` of the transposed text). Texts are zero-padded to the
    longest: a zero block, or a zero inside a block, leaves the contract's sum unchanged bit for bit (its
    chains start at +0 and can never hold -0), so a text's sum is the same alone and in any batch."""
    d, width = h.shape[-1], max(lengths)
    padded = h.new_zeros((len(lengths), width, d), dtype=torch.float32)
    counts = torch.tensor(lengths)
    rows = torch.arange(width)[None, :] < counts[:, None]
    padded[rows] = h.float()
    return row_sums(padded.transpose(1, 2).reshape(-1, width)).view(len(lengths), d)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / max(||x||, 1e-12) per fp32 row (torch's F.normalize), the squares summed in contract 1's order."""
    x = x.float()
    return x / torch.sqrt(row_sums(x * x)).clamp_min(1e-12)
