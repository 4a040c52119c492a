"""The KV cache's storage formats (`--kv-cache-dtype`), and the plain-torch reference of the quantized ones.

`bfloat16` and `float32` store K and V as they are. `int8` and `int4` store each (position, KV head) by itself,
so the cache stays a function of the position's own K/V at any batch: its D values rotated by a Walsh-Hadamard
transform (which spreads an outlier channel over the whole head, so no group's scale is set by one value), then
per group of 32 values an fp32 scale and int8 codes, or int4 codes two to a byte. The order is
`csrc/contract.h`, 6; the compiled kernels (`csrc/paged_kv.cpp`, `csrc/attention.cpp`) follow it, and
`quantize` / `dequantize` below state it again in torch, step for step, so that tests can hold the kernels to it
bit for bit (and the library's padded attention can read a quantized cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

GROUP = 32  # values per scale (as llama.cpp's q8_0 and q4_0 blocks)


@dataclass(frozen=True, slots=True)
class KVFormat:
    storage: torch.dtype
    bits: int                # 16, 32 (plain) or 8, 4 (quantized)
    group: int = 0           # values per fp32 scale (quantized); the head's own size where it does not divide
    rotate: bool = False     # stored in the Hadamard basis (contract.h, 6a)

    @property
    def quantized(self) -> bool:
        return self.bits in (8, 4)

    def group_for(self, head_dim: int) -> int:
        """Values per scale for this head size: gcd(head_dim, group); refused where the kernels cannot read it."""
        g = math.gcd(head_dim, self.group)
        if g % (16 if self.bits == 4 else 8):
            raise ValueError(f"a {self.bits}-bit KV cache needs a head dim that is a multiple of "
                             f"{16 if self.bits == 4 else 8}, got {head_dim}")
        return g

    def width(self, head_dim: int) -> int:
        """Stored elements per (position, head): the values, or their codes (int4: two a byte)."""
        return head_dim // 2 if self.bits == 4 else head_dim

    def bytes_per_head(self, head_dim: int) -> int:
        """One (position, head)'s bytes: its values, or its codes and fp32 scales."""
        if not self.quantized:
            return head_dim * self.bits // 8
        return self.width(head_dim) + 4 * (head_dim // self.group_for(head_dim))


#: every storage format by name; `EngineConfig` offers the first three (float32: tests against fp32 oracles)
KV_FORMATS = {
    "bfloat16": KVFormat(torch.bfloat16, 16),
    "int8": KVFormat(torch.int8, 8, GROUP, rotate=True),
    "int4": KVFormat(torch.uint8, 4, GROUP, rotate=True),
    "float32": KVFormat(torch.float32, 32),
}


class LayerKV(NamedTuple):
    """One layer's paged cache as the kernels take it: K, V [blocks, kv_heads, block, width], and for a quantized
    cache their fp32 scales [blocks, kv_heads, block, groups] (empty tensors otherwise) and whether its values
    are stored rotated. models/kv_cache.py's KVPool.layer."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    rotate: bool = False


# --- the reference, in torch (contract.h, 6) ----------------------------------------------------------------

def hadamard(x: torch.Tensor) -> torch.Tensor:
    """6a's rotation over x's last dimension (fp32): the butterflies of each stage, len = 1, 2, ..., R / 2
    (R the largest power of two dividing it), unnormalized; one fp32 rounding per addition, as the kernels."""
    d = x.shape[-1]
    r = d & -d
    length = 1
    while length < r:
        pairs = x.reshape(*x.shape[:-1], d // (2 * length), 2, length)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), -2).reshape(x.shape)
        length *= 2
    return x


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] (bf16) as 6a-b store them: (codes [..., width], scales [..., D / G])."""
    d = x.shape[-1]
    g = fmt.group_for(d)
    t = x.float()
    if fmt.rotate:
        t = hadamard(t)
    t = t.reshape(*x.shape[:-1], d // g, g)
    mag = t.abs()
    finite = torch.isfinite(t).all(-1)
    amax = torch.where(finite, mag.amax(-1), 0.0)  # a NaN's group: any amax, its scale is NaN below
    if fmt.bits == 4:
        m = torch.gather(t, -1, mag.nan_to_num(0.0).argmax(-1, keepdim=True))[..., 0]  # first of the largest |v|
        scale, low, high = m / -8.0, -8.0, 7.0
    else:
        scale, low, high = amax / 127.0, -127.0, 127.0
    coded = finite & (amax != 0)
    scale = torch.where(finite, torch.where(coded, scale, 0.0), math.nan)
    codes = torch.where(coded[..., None], torch.round(t / torch.where(coded, scale, 1.0)[..., None]), 0.0)
    codes = codes.clamp(low, high)
    if fmt.bits == 8:
        return codes.to(torch.int8).reshape(x.shape), scale
    nib = (codes + 8).to(torch.uint8)
    half = g // 2
    packed = nib[..., :half] | (nib[..., half:] << 4)
    return packed.reshape(*x.shape[:-1], d // 2), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, unrotate: bool = False) -> torch.Tensor:
    """6c's read: code x scale in fp32 ([..., D]), in the stored (rotated) basis; with `unrotate`, taken back to the
    plain one (rotated again, times 1 / R), as the library's padded attention reads it."""
    groups = scales.shape[-1]
    if codes.dtype == torch.uint8:  # int4: byte j of a group holds values j and j + G / 2
        c = codes.reshape(*codes.shape[:-1], groups, -1).to(torch.int32)
        c = torch.cat((c & 15, c >> 4), -1) - 8
    else:
        c = codes.reshape(*codes.shape[:-1], groups, -1).to(torch.int32)
    x = (c.float() * scales[..., None]).reshape(*codes.shape[:-1], -1)
    if unrotate:
        d = x.shape[-1]
        x = hadamard(x) * (1.0 / (d & -d))
    return x
