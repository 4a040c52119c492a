"""The IQ1, IQ2 and IQ3 GGUF types re-coded at load as 3- or 4-bit indices into a table of int8 values.

llama.cpp's grids hold few distinct magnitudes: every weight of these types, its sign (and IQ1's delta)
included, is one of at most 16 integers times a power of two, times an odd integer sub-scale, times the
block's fp16 d (ggml-quants.c's dequantize_row_*, gguf-py's dequantize_blocks):

    IQ2_XXS, IQ2_XS, IQ2_S  +-{8, 25, 43} x (2 s + 1) x d / 8    (d (0.5 + s) / 4, s 4 bits, per 32 or 16)
    IQ3_XXS                 +-{4, 12, 20, ..., 52, 62} x (2 s + 1) x d / 4      (d (0.5 + s) / 2, per 32)
    IQ3_S                   +-{1, 3, ..., 15} x (2 s + 1) x d                   (per 32)
    IQ1_S, IQ1_M            (8 g +- 1) x (2 s + 1) x d / 8, g in {-1, 0, 1}     (grid + delta, delta +-1/8;
                            s 3 bits, per 32 (IQ1_S) or 16 (IQ1_M, whose fp16 d is spread over its scales))

So a weight becomes a code that indexes its type's table (quant_pack.TABLES: 3 bits for the six values of
IQ2 and IQ1, 4 for IQ3's sixteen), the sub-scale 2 s + 1 (at most 31) an int8 s, and the power of two the
table's, applied to d once it is widened to fp32. Every product is exact in fp32 (d has 11 significant
bits, 2 s + 1 five, a value six), so value x s x d x 2^-e is gguf-py's fp32 value bit for bit
(tests/test_quant_iq.py checks each type against it): the integer-exact contract holds as for IQ4_NL.

Memory: 3 bits a weight for IQ2 and IQ1, 4 for IQ3, plus an int8 s per 16 or 32 and an fp16 d per 256
(3.3 to 4.6 bits against the file's 1.56 to 3.44). Kernels that read the grids as they are would need a
gather of an 8- to 11-bit index per 4 or 8 weights (the contract allows it; not written).
"""
from __future__ import annotations

import functools

import numpy as np

from ..kernels.quant_pack import TABLES

QK_K = 256


@functools.cache
def _grid(type_name: str) -> np.ndarray:
    """gguf-py's grid of the type as integers [rows, 4 or 8] (IQ1's: -1, 0, 1)."""
    import gguf

    cls = getattr(gguf.quants, type_name)
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(np.int16)


@functools.cache
def _ksigns() -> np.ndarray:
    """llama.cpp's ksigns_iq2xs as bits [128, 8]: 7 sign bits and their parity as the eighth."""
    import gguf

    k = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, np.uint8)
    return ((k.reshape(-1, 1) >> np.arange(8, dtype=np.uint8)) & 1).astype(np.int16)


@functools.cache
def _index(table: str) -> np.ndarray:
    """value + 128 -> its code in TABLES[table] (the first entry holding it; 0 stays unused)."""
    inv = np.zeros(256, np.uint8)
    for code, v in reversed(list(enumerate(TABLES[table][1]))):
        inv[int(v) + 128] = code
    return inv


def _u32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _u16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _signed(grid: np.ndarray, minus: np.ndarray) -> np.ndarray:
    return np.where(minus.astype(bool), -grid, grid)


def _nibble_scales(sc: np.ndarray) -> np.ndarray:
    """IQ2_XS/IQ2_S/IQ3_S: two 4-bit s a byte (low first) as 2 s + 1."""
    s = (sc[..., None] >> np.array([0, 4], np.uint8)) & 0x0F
    return (2 * s.reshape(sc.shape[0], -1) + 1).astype(np.int8)


def _iq2_xxs(b):
    nb = b.shape[0]
    qs = _u32(b[:, 2:]).reshape(nb, 8, 2)
    grid = _grid("IQ2_XXS")[qs[..., 0].copy().view(np.uint8).reshape(nb, 8, 4)]       # [nb, 8, 4, 8]
    signs = _ksigns()[(qs[..., 1:] >> np.array([0, 7, 14, 21], np.uint32)) & 127]       # [nb, 8, 4, 8]
    s = (2 * (qs[..., 1] >> 28) + 1).astype(np.int8)
    return _signed(grid, signs), _f16(b[:, :2]), s, 32, "iq2"


def _iq2_xs(b):
    nb = b.shape[0]
    qs = _u16(b[:, 2:66]).reshape(nb, 32)
    v = _signed(_grid("IQ2_XS")[qs & 511], _ksigns()[qs >> 9])
    return v, _f16(b[:, :2]), _nibble_scales(b[:, 66:74]), 16, "iq2"


def _iq2_s(b):
    nb = b.shape[0]
    qh = (b[:, 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    idx = b[:, 2:34].astype(np.uint16) | (qh.reshape(nb, 32).astype(np.uint16) << 8)
    signs = (b[:, 34:66, None] >> np.arange(8, dtype=np.uint8)) & 1
    return _signed(_grid("IQ2_S")[idx], signs), _f16(b[:, :2]), _nibble_scales(b[:, 74:82]), 16, "iq2"


def _iq3_xxs(b):
    nb = b.shape[0]
    grid = _grid("IQ3_XXS")[b[:, 2:66]].reshape(nb, 8, 4, 8)
    aux = _u32(b[:, 66:98]).reshape(nb, 8)
    signs = _ksigns()[(aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127]
    return _signed(grid, signs), _f16(b[:, :2]), (2 * (aux >> 28) + 1).astype(np.int8), 32, "iq3xxs"


def _iq3_s(b):
    nb = b.shape[0]
    qh = (b[:, 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1
    idx = b[:, 2:66].astype(np.uint16) | (qh.reshape(nb, 64).astype(np.uint16) << 8)
    signs = (b[:, 74:106, None] >> np.arange(8, dtype=np.uint8)) & 1
    v = _signed(_grid("IQ3_S")[idx].reshape(nb, -1), signs.reshape(nb, -1))
    return v, _f16(b[:, :2]), _nibble_scales(b[:, 106:110]), 32, "iq3s"


def _iq1(grid_index: np.ndarray, minus: np.ndarray) -> np.ndarray:
    """8 (g + delta) for each run of 8 weights: 8 g + 1, or 8 g - 1 where the delta is negative."""
    g = _grid("IQ1_S")[grid_index]
    return 8 * g + np.where(minus, -1, 1).astype(np.int16)[..., None]


def _iq1_s(b):
    nb = b.shape[0]
    qh = _u16(b[:, 34:50]).reshape(nb, 8)
    high = (qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7
    idx = b[:, 2:34].reshape(nb, 8, 4).astype(np.uint16) | (high << 8)
    v = _iq1(idx, np.broadcast_to((qh & 0x8000)[..., None] != 0, idx.shape))
    return v, _f16(b[:, :2]), (2 * ((qh >> 12) & 7) + 1).astype(np.int8), 32, "iq1"


def _iq1_m(b):
    nb = b.shape[0]
    sc = _u16(b[:, 48:56]).reshape(nb, 4)
    d = ((sc & 0xF000) >> np.array([12, 8, 4, 0], np.uint16)).sum(axis=1, dtype=np.uint16)  # disjoint bits: OR
    nib = (b[:, 32:48, None] >> np.array([0, 4], np.uint8)).reshape(nb, 32)
    idx = b[:, :32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
    s = (2 * ((sc[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) + 1).reshape(nb, 16).astype(np.int8)
    return _iq1(idx, (nib & 8) != 0), d.view(np.float16).reshape(nb, 1), s, 16, "iq1"


def extractor(decode):
    """quant_codes' extraction (codes, d, s, d_off, s_off, bits, zero, group, block) from a decoder's integer
    values (8 and 3 bits for the six values of IQ2 and IQ1, else 4)."""
    def extract(b):
        v, d, s, group, table = decode(b)
        v = v.reshape(b.shape[0], QK_K)
        codes = _index(table)[(v + 128).astype(np.uint8)]
        if not np.array_equal(TABLES[table][1][codes], v):  # a grid value the table lacks: never silently
            raise ValueError(f"a {table} grid value is not in its table")
        return codes, d, s, None, None, 3 if len(TABLES[table][1]) == 8 else 4, 0, group, QK_K
    return extract


# GGUF type name -> (block size, bytes per block, the extraction, its table)
IQ_TYPES = {"IQ2_XXS": (QK_K, 66, extractor(_iq2_xxs), "iq2"), "IQ2_XS": (QK_K, 74, extractor(_iq2_xs), "iq2"),
            "IQ2_S": (QK_K, 82, extractor(_iq2_s), "iq2"), "IQ3_XXS": (QK_K, 98, extractor(_iq3_xxs), "iq3xxs"),
            "IQ3_S": (QK_K, 110, extractor(_iq3_s), "iq3s"), "IQ1_S": (QK_K, 50, extractor(_iq1_s), "iq1"),
            "IQ1_M": (QK_K, 56, extractor(_iq1_m), "iq1")}
