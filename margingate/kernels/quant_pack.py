"""Quantized weights that stay quantized: a matrix's GGUF codes and scales repacked once into panels.

Every element is `bf16(scale * (q - zero) [+ offset])`, the fp32 arithmetic gguf-py's dequantizer
does and then the one rounding the bf16 loader does, so it holds exactly the bf16 value the loader
would have stored (csrc/quant.cpp). The linear dequantizes a few panels at a time into a scratch and
runs its path over them: the same products in the same order, the same bits as the bf16 weights, at
a fraction of the bytes. A matrix is one uint8 tensor: a header of int64 words, then its parts,
each a run of 16-row panels in one format (a fused q|k|v may hold two GGUF types):

    header: magic "MGQ1", n, k, parts; per part: panels, group, bits, zero, codes at, scales at,
    offsets at (-1: none), 0.
    codes:  4-bit [panels, k / 2, 16] (k even in the low nibble) or 8-bit signed [panels, k / 2, 16, 2]
    scales, offsets: fp32 [panels, k / group, 16]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .packing import PANEL, PackedWeight

MAGIC, ALIGN = 0x3151474D, 64


@dataclass(frozen=True)
class QuantCodes:
    """One matrix (or a run of its rows) as codes and scales: element (r, j) is
    bf16(scale[r, j // group] * (codes[r, j] - zero) [+ offset[r, j // group]])."""
    codes: np.ndarray          # [n, k]: 4-bit values 0..15 (uint8), or 8-bit signed values (int8)
    scale: np.ndarray          # [n, k // group] fp32
    offset: np.ndarray | None  # the same shape, or None
    bits: int
    zero: int
    group: int
    format: str                # the GGUF type it came from ("q4_k"), for reports

    def bf16(self) -> torch.Tensor:
        """The plain [n, k] bf16 matrix: the same fp32 operations, then torch's rounding."""
        q = (self.codes.astype(np.int32) - self.zero).astype(np.float32).reshape(*self.scale.shape, self.group)
        v = self.scale[..., None] * q
        if self.offset is not None:
            v = v + self.offset[..., None]
        return torch.from_numpy(v.reshape(self.codes.shape)).to(torch.bfloat16)


@dataclass(frozen=True)
class QuantWeight:
    """A quantized [n, k] matrix for the invariant linear (`data`: the uint8 tensor above)."""
    data: torch.Tensor
    n: int
    k: int
    formats: tuple[str, ...]  # each part's GGUF type

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """W[index] ([..., k] bf16): an embedding lookup, dequantized row by row."""
        from . import invariant
        got = invariant.ops().dequantize_rows(self.data, index.reshape(-1))
        return got.reshape(*index.shape, self.k)

    def unpack(self) -> torch.Tensor:
        """The plain [n, k] bf16 matrix (a new tensor): the library kernels' copy."""
        from . import invariant
        return PackedWeight(invariant.ops().dequantize_packed(self.data), self.n, self.k).unpack()


def panelable(parts: list[QuantCodes]) -> bool:
    """Whether these row runs can be one quantized matrix: every run but the last fills whole panels,
    all share k, and k is a multiple of 32 (the linear's block)."""
    k = parts[0].codes.shape[1]
    return k % 32 == 0 and all(p.codes.shape[1] == k for p in parts) and \
        all(p.codes.shape[0] % PANEL == 0 for p in parts[:-1])


def quant_weight(parts: list[QuantCodes]) -> QuantWeight:
    """The runs of rows `parts`, in order, as one quantized matrix (check `panelable` first)."""
    if not panelable(parts):
        raise ValueError("quantized rows that do not fill whole panels, or of different widths")
    n, k = sum(p.codes.shape[0] for p in parts), parts[0].codes.shape[1]
    arrays = [_panels(p) for p in parts]
    at = _up(8 * (4 + 8 * len(parts)))
    head = [MAGIC, n, k, len(parts)]
    for p, (codes, scale, offset) in zip(parts, arrays):
        places = []
        for a in (codes, scale, offset):
            places.append(at if a is not None else -1)
            at += _up(a.nbytes) if a is not None else 0
        head += [codes.shape[0], p.group, p.bits, p.zero, *places, 0]
    blob = np.zeros(at, np.uint8)
    blob[:8 * len(head)] = np.array(head, np.int64).view(np.uint8)
    for i, a in enumerate(x for triple in arrays for x in triple):
        if a is not None:
            start = head[4 + 8 * (i // 3) + 4 + i % 3]
            blob[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
    return QuantWeight(torch.from_numpy(blob), n, k, tuple(p.format for p in parts))


def _up(v: int) -> int:
    return -(-v // ALIGN) * ALIGN


def _panels(p: QuantCodes) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes, scales and offsets in panel order, the rows padded to whole panels with zeros."""
    n, k = p.codes.shape
    pad = -n % PANEL
    codes = np.pad(p.codes, ((0, pad), (0, 0)))
    if p.bits == 4:
        pairs = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # [n, k / 2]
        codes = pairs.reshape(-1, PANEL, k // 2).transpose(0, 2, 1)
    else:
        codes = codes.astype(np.int8).reshape(-1, PANEL, k // 2, 2).transpose(0, 2, 1, 3)

    def by_panel(s):
        return None if s is None else np.pad(s, ((0, pad), (0, 0))).reshape(-1, PANEL, s.shape[1]).transpose(0, 2, 1)
    return (np.ascontiguousarray(codes), np.ascontiguousarray(by_panel(p.scale), np.float32),
            None if p.offset is None else np.ascontiguousarray(by_panel(p.offset), np.float32))
