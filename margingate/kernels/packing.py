"""Weights packed once at load into the panel layout every path of the invariant linear reads.

Panel p holds output columns [16p, 16p + 16); its pair q is 32 bf16, (W[16p + l][2q],
W[16p + l][2q + 1]) for l = 0..15: AMX's VNNI layout for B tiles, and for the AVX-512 / AVX2
paths one vector of 16 (or 8) columns' pairs (csrc/contract.h). K is zero-padded to a multiple
of 32, N to a multiple of 16. The packed tensor replaces the plain one: a model keeps one copy
of its weights. Rows of a packed matrix are read back for an embedding lookup (a tied model's
embedding is its packed head) and the whole matrix unpacked only for the library kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PANEL, BLOCK = 16, 32  # csrc/contract.h: kPanel, kBlock
# The version of the packed layouts (`pack`'s panels and quant_pack's matrices): bump it when either changes,
# so that the cache of packed models (models/packed_cache.py) never hands old bytes to new kernels.
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class PackedWeight:
    """W [n, k] (bf16) as panels: `data` [ceil(n / 16), ceil32(k) / 2, 16, 2]."""
    data: torch.Tensor
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """W[index] ([..., k] bf16), read from the panels: a tied model's embedding lookup."""
        flat = index.reshape(-1)
        got = self.data[flat // PANEL, :, flat % PANEL, :]  # [T, kp / 2, 2]
        return got.reshape(flat.shape[0], -1)[:, :self.k].reshape(*index.shape, self.k)

    def unpack(self) -> torch.Tensor:
        """The plain [n, k] matrix again (a new tensor)."""
        panels, pairs = self.data.shape[:2]
        return self.data.permute(0, 2, 1, 3).reshape(panels * PANEL, pairs * 2)[:self.n, :self.k].contiguous()


def pack(w: torch.Tensor) -> PackedWeight:
    """Pack a [n, k] weight (cast to bf16 exactly as stored)."""
    if w.dim() != 2:
        raise ValueError(f"only matrices are packed, not a tensor of shape {list(w.shape)}")
    n, k = w.shape
    np_, kp = -(-n // PANEL) * PANEL, -(-k // BLOCK) * BLOCK
    padded = F.pad(w.to(torch.bfloat16), (0, kp - k, 0, np_ - n))
    data = padded.view(np_ // PANEL, PANEL, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    return PackedWeight(data, n, k)
