"""Rotary position embedding: the cos/sin tables and the rotation (Hugging Face's layout).

Both are per position and elementwise, so a position's bits never depend on the forward
it arrives in: the tables are computed once per position, the rotation rounds each op once.
"""
from __future__ import annotations

import math

import torch


class RotaryTable:
    """cos/sin of every position, each value computed on its own (Python's libm, double, then
    rounded to fp32): a position's entry never depends on how many positions a forward holds
    or on the thread count (a vectorized library cos treats a tensor's tail differently)."""

    def __init__(self, head_dim: int, theta: float, inv_freq: torch.Tensor | None = None, scale: float = 1.0):
        """`inv_freq`: the fp32 inverse frequencies where a RoPE scaling sets them (models/rope_scaling.py);
        else plain RoPE's at base `theta`. `scale`: what cos and sin are multiplied by (YaRN's attention
        factor), in fp32, as transformers does before casting them."""
        self.scale = scale
        if inv_freq is None:
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
            inv_freq = 1.0 / (theta ** exponents)
        self.inv_freq = inv_freq.tolist()
        self.tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.size = 0
        self.reserved = False  # grown ahead (`reserve`): lookups no longer read their positions on the host

    def reserve(self, n: int) -> None:
        """Hold positions [0, n) now and stop checking each lookup's positions on the host, a sync that a
        CUDA graph cannot hold; a position past them then fails the device's own index check, loudly."""
        if n > self.size:
            self._grow(n)
        self.reserved = True

    def _grow(self, n: int) -> None:
        size = max(256, 1 << (n - 1).bit_length())
        angles = (torch.arange(size, dtype=torch.float32)[:, None] * torch.tensor(self.inv_freq)[None, :]).tolist()
        cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float32)
        sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float32)
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        self.tables = {(torch.float32, torch.device("cpu")): (cos, sin)}
        self.size = size

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, D] cos and sin for these positions, in `dtype`, on their device (the fp32 table cast
        and moved once per dtype and device)."""
        if not self.reserved and int(positions.max()) + 1 > self.size:
            self._grow(int(positions.max()) + 1)
        key = (dtype, positions.device)
        if key not in self.tables:
            cos, sin = self.tables[(torch.float32, torch.device("cpu"))]
            self.tables[key] = (cos.to(positions.device, dtype), sin.to(positions.device, dtype))
        cos, sin = self.tables[key]
        return cos[positions][:, None], sin[positions][:, None]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]. Rotates the two halves of each head (HF layout). Elementwise ops
    only, each rounded once: the same bits for a position in any forward."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
