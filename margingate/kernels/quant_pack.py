"""Quantized weights that stay quantized: a matrix's GGUF codes and scales repacked once into panels.

Every element is `bf16(scale * (q - zero) [+ offset])`, the fp32 arithmetic gguf-py's dequantizer
does and then the one rounding the bf16 loader does, so it holds exactly the bf16 value the loader
would have stored (csrc/quant.cpp). The scales are kept as the file has them: scale = d * s, with
d an fp16 per block (256 k for the K-quants, 32 for the others) and s an int8 per group of 32 (16 for
Q6_K) or none; the offset likewise. The product is exact, so it is gguf-py's fp32 scale, at the file's
bytes. The linear dequantizes a few panels at a time into a scratch and runs its path over them: the
same products in the same order, the same bits as the bf16 weights. A matrix is one uint8 tensor: a
header of int64 words, then its parts, each a run of 16-row panels in one format (a fused q|k|v may
hold two GGUF types):

    header: magic "MGQ2", n, k, parts; per part: panels, group, block, bits, zero, then where its
    codes, high, d, s, d_off and s_off lie (-1: none), then its code table (TABLES; 0: none).
    codes: 4 to 6 bits: the low 4 bits of a pair in a byte [panels, k / 2, 16] (k even in the low
    nibble); 8 bits: signed [panels, k / 2, 16, 2].
    high (5 and 6 bits): the bits above 4 [panels, k / 2 / R, 16, 2], R = 8 / (bits - 4) pair rows
    per byte, pair row r of a run at bit (bits - 4) * r.
    d, d_off: fp16 [panels, k / block, 16]; s, s_off: int8 [panels, k / group, 16].

A matrix under the integer-exact contract (`contract="int8"`, csrc/contract.h, 5; magic "MGI8") has the
same header and scales; only its codes are ordered for integer dot products, by quads of 4 k. Per
panel and quad, code i = 4 * column + (k % 4) for columns 0..15 (i in 0..63):
    codes: 4 to 6 bits: 32 bytes, byte i % 32's nibble i // 32 (low, then high) holds code i's low
    4 bits; 2 and 3 bits: 16 bytes, bits 2 (i // 16) of byte i % 16 hold its low 2 bits; 8 bits: 64
    signed bytes, byte i.
    high: 3 and 5 bits: 8 bytes, bit i // 8 of byte i % 8; 6 bits: 16 bytes, bits 2 (i // 16) of byte i % 16.
Only this contract has 2- and 3-bit codes (Q2_K, Q3_K) and 3- or 4-bit codes that index a table of int8
values (IQ4_NL, IQ4_XS, and the IQ1/IQ2/IQ3 grids re-coded at load: the part's last header word names the
table, TABLES, and with it the power of two its values are scaled by); the bf16 contract dequantizes those
types at load.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

from .extension import load
from .packing import PANEL, PackedWeight

MAGIC, ALIGN, PART_WORDS = 0x3251474D, 64, 12
MAGIC_INT8 = 0x3849474D  # "MGI8"
CONTRACTS = ("exact", "int8")  # bf16 bits of the dequantized weight | the integer-exact contract
# Code tables by name: (the header's id, the int8 values a 3- or 4-bit code indexes, e): code c means
# values[c] x 2^-e, the power of two applied to d once it is widened to fp32 (exact). csrc/quant_codes.h holds
# the same values under the same id. IQ4: kvalues_iq4nl. The IQ grids' values with their signs (the IQ types
# are re-coded at load, models/gguf_iq.py): IQ2_XXS/XS/S +-{8, 25, 43} / 8 (the 1/8 of their d (0.5 + s) / 4);
# IQ3_XXS +-{4, 12, ..., 62} / 4; IQ3_S +-{1, 3, ..., 15}; IQ1_S/M 8 g +- 1 (grid g in {-1, 0, 1}, delta
# +-1/8) / 8. MXFP4: E2M1's values doubled (gguf-py's convention, the scale halved). Unused entries are 0.
TABLES = {"iq4nl": (1, np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8),
                    0),
          "iq2": (2, np.array([8, 25, 43, 0, -8, -25, -43, 0], np.int8), 3),
          "iq3xxs": (3, np.array([4, 12, 20, 28, 36, 44, 52, 62, -4, -12, -20, -28, -36, -44, -52, -62], np.int8), 2),
          "iq3s": (4, np.array([1, 3, 5, 7, 9, 11, 13, 15, -1, -3, -5, -7, -9, -11, -13, -15], np.int8), 0),
          "iq1": (5, np.array([-7, 1, 9, 0, -9, -1, 7, 0], np.int8), 3),
          "mxfp4": (6, np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8), 0)}
# Rows decoded and laid out at a time: the temporaries of a 128k-row head are those of 2048 rows (a few MB),
# not several times the head's own size at the peak of a first load.
CHUNK_ROWS = 2048


@dataclass(frozen=True)
class QuantCodes:
    """One matrix (or a run of its rows) as codes and the file's scales: element (r, j) is
    bf16(scale[r, j] * (value[r, j] - zero) [+ offset[r, j]]), scale = d[r, j // block] * s[r, j // group]
    in fp32 (s None: 1), the offset from d_off and s_off likewise (d_off None: no offset); a code's value
    is the code, or the entry of `table` it indexes."""
    codes: np.ndarray           # [n, k]: 4- to 6-bit values (uint8), or 8-bit signed values (int8)
    d: np.ndarray               # [n, k // block] fp16
    s: np.ndarray | None        # [n, k // group] int8
    d_off: np.ndarray | None    # like d
    s_off: np.ndarray | None    # like s
    bits: int
    zero: int
    group: int
    block: int
    format: str                 # the GGUF type it came from ("q4_k"), for reports
    table: str | None = None    # 3- or 4-bit codes index TABLES[table]'s values (times its 2^-e)
    row_unit: ClassVar[int] = 1  # a run of its rows may start at any row (RowSource)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def run(self, start: int, stop: int) -> QuantCodes:
        """Rows [start, stop): views, no copy."""
        def rows(a):
            return None if a is None else a[start:stop]
        return dataclasses.replace(self, codes=self.codes[start:stop], d=self.d[start:stop], s=rows(self.s),
                                   d_off=rows(self.d_off), s_off=rows(self.s_off))

    @property
    def exact_layout(self) -> bool:
        """Whether the bf16 contract has a layout for these codes (else only the integer-exact one)."""
        return self.bits in (4, 5, 6, 8) and self.table is None

    def exact_form(self) -> QuantCodes:
        """These codes in a layout the bf16 contract has, where one holds them exactly: a table whose power of two
        is 1 and whose values lie in [-16, 15] (MXFP4, IQ3_S) as 5-bit codes value + 16, zero 16 (Q5_0's shape);
        else these codes as they are."""
        if self.exact_layout or self.table is None or TABLES[self.table][2] != 0:
            return self
        table = TABLES[self.table][1]
        if table.min() < -16 or table.max() > 15:
            return self
        codes = (table[self.codes].astype(np.int16) - self.zero + 16).astype(np.uint8)
        return dataclasses.replace(self, codes=codes, bits=5, zero=16, table=None)

    def values(self) -> np.ndarray:
        """[n, k] int32: each code's integer value (through the table where there is one), less the zero point."""
        v = TABLES[self.table][1][self.codes] if self.table else self.codes  # the table's integers (before 2^-e)
        return v.astype(np.int32) - self.zero

    @property
    def unit(self) -> np.float32:
        """2^-e of the table (1 without one): what d is multiplied by once widened to fp32 (exact)."""
        return np.float32(2.0 ** -TABLES[self.table][2]) if self.table else np.float32(1)

    def scales(self, d: np.ndarray, s: np.ndarray | None) -> np.ndarray:
        """[n, k // group] fp32: d (times the table's unit) * s, the product gguf-py forms (exact)."""
        v = np.repeat(d.astype(np.float32) * self.unit, self.block // self.group, axis=1)
        return v if s is None else v * s.astype(np.float32)

    def fp32(self) -> np.ndarray:
        """The plain [n, k] fp32 matrix: gguf-py's dequantized values (exact products; tests check the bits)."""
        n, k = self.codes.shape
        q = self.values().astype(np.float32).reshape(n, k // self.group, self.group)
        v = self.scales(self.d, self.s)[..., None] * q
        if self.d_off is not None:
            v = v + self.scales(self.d_off, self.s_off)[..., None]
        return v.reshape(n, k)

    def bf16(self) -> torch.Tensor:
        """The plain [n, k] bf16 matrix: the same fp32 operations, then torch's rounding."""
        return torch.from_numpy(self.fp32()).to(torch.bfloat16)


@dataclass(frozen=True)
class QuantWeight:
    """A quantized [n, k] matrix for the invariant linear (`data`: the uint8 tensor above)."""
    data: torch.Tensor
    n: int
    k: int
    formats: tuple[str, ...]  # each part's GGUF type
    contract: str = "exact"   # one of CONTRACTS

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """W[index] ([..., k] bf16): an embedding lookup, dequantized row by row."""
        got = load().dequantize_rows(self.data, index.reshape(-1))
        return got.reshape(*index.shape, self.k)

    def unpack(self) -> torch.Tensor:
        """The plain [n, k] bf16 matrix (a new tensor): the library kernels' copy."""
        return PackedWeight(load().dequantize_packed(self.data), self.n, self.k).unpack()


class RowSource(Protocol):
    """A run of a matrix's rows as codes (QuantCodes itself, or a GGUF's matrix decoded from the file a run at a
    time: models/weights.BlockSource). A run starts at a multiple of `row_unit` rows (a GGUF's Q and K undo
    llama.cpp's row interleave per head)."""
    shape: tuple[int, int]
    row_unit: int

    def run(self, start: int, stop: int) -> QuantCodes: ...


def panelable(parts: list[RowSource]) -> bool:
    """Whether these row runs can be one quantized matrix: every run but the last fills whole panels,
    all share k, and k is a multiple of 32 (the linear's block)."""
    k = parts[0].shape[1]
    return k % 32 == 0 and all(p.shape[1] == k for p in parts) and all(p.shape[0] % PANEL == 0 for p in parts[:-1])


def quant_weight(parts: list[RowSource], contract: str = "exact") -> QuantWeight:
    """The runs of rows `parts`, in order, as one quantized matrix (check `panelable` first), for the
    contract `contract`: "exact" (its bf16 values reduced in the bf16 order) or "int8" (int8
    activations, exact integer sums: csrc/contract.h, 5). Each part is decoded and laid out CHUNK_ROWS rows
    at a time, straight into the matrix: every field is panel-major, so a run's panels have their own place."""
    if not panelable(parts):
        raise ValueError("quantized rows that do not fill whole panels, or of different widths")
    if contract not in CONTRACTS:
        raise ValueError(f"quantized contract must be one of {', '.join(CONTRACTS)}; got {contract!r}")
    runs = [_runs(p, contract) for p in parts]
    firsts = [next(r) for r in runs]  # (first row, codes, fields): each part's layout, and its first run
    if contract == "exact" and not all(c.exact_layout for _, c, _ in firsts):
        types = ", ".join(sorted({c.format for _, c, _ in firsts if not c.exact_layout}))
        raise ValueError(f"{types} has no layout under the exact contract: dequantize it, or use the int8 one")
    n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    at = _up(8 * (4 + PART_WORDS * len(parts)))
    head = [MAGIC if contract == "exact" else MAGIC_INT8, n, k, len(parts)]
    for p, (_, c, fields) in zip(parts, firsts):
        panels, places = -(-p.shape[0] // PANEL), []
        for a in fields:
            places.append(at if a is not None else -1)
            at += _up(a.nbytes // a.shape[0] * panels) if a is not None else 0
        head += [panels, c.group, c.block, c.bits, c.zero, *places, TABLES[c.table][0] if c.table else 0]
    blob = np.zeros(at, np.uint8)
    blob[:8 * len(head)] = np.array(head, np.int64).view(np.uint8)
    for i, (first, rest) in enumerate(zip(firsts, runs)):
        for start, _, fields in itertools.chain([first], rest):
            for place, a in zip(head[4 + PART_WORDS * i + 5:], fields):
                if a is not None:
                    place += start // PANEL * (a.nbytes // a.shape[0])
                    blob[place:place + a.nbytes] = a.reshape(-1).view(np.uint8)
    return QuantWeight(torch.from_numpy(blob), n, k, tuple(c.format for _, c, _ in firsts), contract)


def _runs(part: RowSource, contract: str) -> Iterator[tuple[int, QuantCodes, list[np.ndarray | None]]]:
    """Each run of about CHUNK_ROWS rows of `part` (whole panels and whole row units): its first row, its codes
    and its fields as the contract lays them out."""
    n, step = part.shape[0], math.lcm(PANEL, part.row_unit)
    step *= max(1, CHUNK_ROWS // step)
    for start in range(0, n, step):
        c = part.run(start, min(start + step, n))
        if contract == "exact":  # a table it can hold as plain codes (MXFP4, IQ3_S)
            c = c.exact_form()
        yield start, c, _int8_fields(c) if contract == "int8" else _panels(c)


def _up(v: int) -> int:
    return -(-v // ALIGN) * ALIGN


def _panels(p: QuantCodes) -> list[np.ndarray | None]:
    """Codes, high bits, d, s, d_off and s_off in panel order, the rows padded to whole panels with zeros."""
    n, k = p.codes.shape
    codes = np.pad(p.codes, ((0, -n % PANEL), (0, 0)))
    pairs = codes.reshape(-1, PANEL, k // 2, 2).transpose(0, 2, 1, 3)  # [panels, k / 2, 16, 2]
    high = None
    if p.bits == 8:
        low = pairs.astype(np.int8)
    else:
        low = (pairs[..., 0] & 15) | ((pairs[..., 1] & 15) << 4)
        if p.bits > 4:
            width = p.bits - 4
            runs = (pairs >> 4).reshape(pairs.shape[0], -1, 8 // width, PANEL, 2)
            high = sum(runs[:, :, r] << (width * r) for r in range(8 // width))
    fields = [low.astype(np.uint8) if p.bits != 8 else low, high]
    return [None if a is None else np.ascontiguousarray(a) for a in fields] + _scales_by_panel(p)


def _scales_by_panel(p: QuantCodes) -> list[np.ndarray | None]:
    """d, s, d_off and s_off as [panels, k / block or k / group, 16], the rows padded with zeros."""
    pad = -p.codes.shape[0] % PANEL

    def by_panel(a):
        return None if a is None else np.ascontiguousarray(
            np.pad(a, ((0, pad), (0, 0))).reshape(-1, PANEL, a.shape[1]).transpose(0, 2, 1))
    return [by_panel(p.d), by_panel(p.s), by_panel(p.d_off), by_panel(p.s_off)]


def _int8_fields(p: QuantCodes) -> list[np.ndarray | None]:
    """The int8 contract's codes and high bits (module docstring), then the scales as `_panels` has them."""
    n, k = p.codes.shape
    codes = np.pad(p.codes, ((0, -n % PANEL), (0, 0)))
    by_quad = codes.reshape(-1, PANEL, k // 4, 4).transpose(0, 2, 1, 3).reshape(-1, k // 4, 4 * PANEL)
    return [_quads(p.bits, by_quad), _quads_high(p.bits, by_quad), *_scales_by_panel(p)]


def _quads(bits: int, c: np.ndarray) -> np.ndarray:
    """The int8 contract's code bytes from the codes by quad [panels, k / 4, 64] (code i = 4 * column + k % 4):
    nibbles of codes i and 32 + i, 2-bit fields of codes i, 16 + i, 32 + i and 48 + i, or signed bytes."""
    if bits == 8:
        return np.ascontiguousarray(c, dtype=np.int8)
    if bits <= 3:
        return _fields(c & 3, 2, 16)
    return ((c[..., :32] & 15) | ((c[..., 32:] & 15) << 4)).astype(np.uint8)


def _quads_high(bits: int, c: np.ndarray) -> np.ndarray | None:
    """The int8 contract's high bits (module docstring) from the codes by quad; None for 2, 4 and 8 bits."""
    if bits not in (3, 5, 6):
        return None
    low = 2 if bits == 3 else 4
    return _fields(c >> low, bits - low, 8 if bits - low == 1 else 16)


def _fields(v: np.ndarray, width: int, lanes: int) -> np.ndarray:
    """[..., 64] values of `width` bits into [..., lanes] bytes: field f of byte b holds value f * lanes + b."""
    fields = v.reshape(*v.shape[:-1], 64 // lanes, lanes).astype(np.uint8)
    shifts = (width * np.arange(64 // lanes, dtype=np.uint8)).reshape(-1, 1)
    return (fields << shifts).sum(axis=-2, dtype=np.uint8)
