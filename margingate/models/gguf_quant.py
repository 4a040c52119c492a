"""GGUF tensors kept quantized: each supported type's blocks as codes and the file's own scales.

For every type below, `bf16(scale * (value - zero) [+ offset])` computes exactly what gguf-py's
dequantizer computes in fp32 (the same operations on the same values, in the same order: the K-quants'
scale is the fp32 product d * sc, as gguf-py forms it), so the value is the bf16 the loader stores
(tests/test_quantized.py checks every type). A code's value is the code, or for IQ4_NL and IQ4_XS the
entry of llama.cpp's 16-value table kvalues_iq4nl it indexes (for the IQ1, IQ2 and IQ3 grids, re-coded at
load by gguf_iq, the entry of their own table, times its power of two). The scales stay as the file stores them
(fp16 d; 4-, 6- or 8-bit sc widened to int8), so a matrix kept quantized takes about the file's bytes.
Q2_K, Q3_K and the IQ types have a layout under the integer-exact contract only (quant_pack); under
`--weights exact` they are dequantized at load.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels.quant_pack import QuantCodes
from .gguf_iq import IQ_TYPES

QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """gguf-py's nibble order: each run of `run` bytes gives `run` low nibbles, then `run` high ones."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(nb, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1: bit i of the 32-bit word is element i's fifth bit."""
    qh = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(count, dtype=np.uint32).reshape(1, -1)
    return (qh & np.uint32(1)).astype(np.uint8)


# Each extraction: codes, d, s, d_off, s_off, bits, zero, group, block (QuantCodes' fields).
def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, None, None, 8, 0, 32, 32


def _q4_0(b):
    return _nibbles(b[:, 2:], 16), _f16(b[:, :2]), None, None, None, 4, 8, 32, 32


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), None, _f16(b[:, 2:4]), None, 4, 0, 32, 32


def _q5_0(b):
    q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << np.uint8(4))
    return q, _f16(b[:, :2]), None, None, None, 5, 16, 32, 32


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << np.uint8(4))
    return q, _f16(b[:, :2]), None, _f16(b[:, 2:4]), None, 5, 0, 32, 32


def _k_scales(b: np.ndarray) -> tuple:
    """Q4_K/Q5_K: d and the 6-bit sc (scale d * sc per 32 elements), -dmin and the 6-bit m (offset
    -(dmin * m): negating the fp16 is exact, so the product is gguf-py's)."""
    nb = b.shape[0]
    s = b[:, 4:16].reshape(nb, 3, 4)
    dd, mm, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([dd & 0x3F, (md & 0x0F) | ((dd >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30)], axis=-1)
    return _f16(b[:, :2]), sc.astype(np.int8), -_f16(b[:, 2:4]), mn.astype(np.int8)


def _q4_k(b):
    return _nibbles(b[:, 16:], 32), *_k_scales(b), 4, 0, 32, QK_K


def _q5_k(b):
    nb = b.shape[0]
    ql = _nibbles(b[:, 48:], 32).reshape(nb, -1, 32)
    qh = b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (ql | ((qh & np.uint8(1)) << np.uint8(4))).reshape(nb, -1)
    return q, *_k_scales(b), 5, 0, 32, QK_K


def _q2_k(b):
    """d * sc * q - dmin * m per 16: 2-bit codes, 4-bit sc and m (the offset -dmin * m, as Q4_K's)."""
    nb = b.shape[0]
    q = (b[:, 16:80].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    sc = b[:, :16]
    return q.reshape(nb, -1), _f16(b[:, 80:82]), (sc & 0x0F).astype(np.int8), -_f16(b[:, 82:84]), \
        (sc >> 4).astype(np.int8), 2, 0, 16, QK_K


def _q3_k(b):
    """d * (sc - 32) * (q - 4) per 16: 3-bit codes (2 low bits, the third in hmask), 6-bit sc."""
    nb = b.shape[0]
    low = (b[:, 32:96].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    high = (b[:, :32].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = low.reshape(nb, -1) | (high.reshape(nb, -1) << np.uint8(2))
    ls = b[:, 96:104].reshape(nb, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    hs = b[:, 104:108].reshape(nb, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    sc = (ls.reshape(nb, 16) & 0x0F) | ((hs.reshape(nb, 16) & 0x03) << 4)
    return q, _f16(b[:, 108:110]), sc.astype(np.int8) - np.int8(32), None, None, 3, 4, 16, QK_K


def _iq4_nl(b):
    return _nibbles(b[:, 2:], 16), _f16(b[:, :2]), None, None, None, 4, 0, 32, 32


def _iq4_xs(b):
    """d * (ls - 32) * kvalues_iq4nl[q] per 32: ls 4 low bits in scales_l, 2 high in scales_h."""
    nb = b.shape[0]
    lo = (b[:, 4:8].reshape(nb, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(nb, 8) & 0x0F
    hi = (np.ascontiguousarray(b[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (lo | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    return _nibbles(b[:, 8:], 16), _f16(b[:, :2]), ls, None, None, 4, 0, 32, QK_K


def _q6_k(b):
    nb = b.shape[0]
    ql = _nibbles(b[:, :QK_K // 2], 64).reshape(nb, -1, 32)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    qh = b[:, QK_K // 2:QK_K // 2 + QK_K // 4].reshape(nb, -1, 1, 32) >> shifts
    q = (ql | ((qh & np.uint8(3)).reshape(nb, -1, 32) << np.uint8(4))).reshape(nb, -1)
    return q, _f16(b[:, 208:210]), b[:, 192:208].view(np.int8), None, None, 6, 32, 16, QK_K


# MXFP4 (gpt-oss's experts): per 32 values an E8M0 exponent byte e and 16 bytes of E2M1 codes; value =
# MXFP4_VALUES[code] * 2^(e - 128) (gguf-py: the E2M1 values doubled, the scale halved). The doubled values are
# the integers {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12}: the file's 4-bit codes index them as a table (quant_pack
# TABLES "mxfp4"), IQ4_NL's shape, with d = 2^(e - 128) in fp16, a power of two that fp16 holds exactly for e in
# [104, 143] (a block of zeros whatever its e): 4.5 bits a weight in memory against the file's 4.25. The bf16
# contract, which has no table layout, holds them as Q5_0's shape (`QuantCodes.exact_form`: 5.5 bits).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _mxfp4(b):
    q = _nibbles(b[:, 1:], 16)
    d = np.ldexp(np.float32(1), b[:, 0].astype(np.int32) - 128).astype(np.float32)
    zero_block = (MXFP4_VALUES[q] == 0).all(axis=1)
    d = np.where(zero_block, np.float32(0), d)
    with np.errstate(over="ignore"):  # a scale past fp16 becomes inf here, and is refused just below
        d16 = d.astype(np.float16)
    if not (d16.astype(np.float32) == d).all():
        bad = int(b[~(d16.astype(np.float32) == d), 0][0])
        raise QuantFormatError(f"MXFP4 block scale 2^{bad - 128} lies outside what fp16 holds exactly "
                               "(2^-24 .. 2^15): this file's experts cannot be kept quantized")
    return q, d16.reshape(-1, 1), None, None, None, 4, 0, 32, 32


# GGUF type name -> (block size, bytes per block, the extraction)
TYPES = {"Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0),
         "Q5_1": (32, 24, _q5_1), "Q4_K": (256, 144, _q4_k), "Q5_K": (256, 176, _q5_k), "Q6_K": (256, 210, _q6_k),
         "MXFP4": (32, 17, _mxfp4),
         "Q2_K": (256, 84, _q2_k), "Q3_K": (256, 110, _q3_k), "IQ4_NL": (32, 18, _iq4_nl),
         "IQ4_XS": (256, 136, _iq4_xs)}
TABLED = {"IQ4_NL": "iq4nl", "IQ4_XS": "iq4nl", "MXFP4": "mxfp4"}  # types whose codes index a table (quant_pack.TABLES)
TYPES.update({t: v[:3] for t, v in IQ_TYPES.items()})  # the IQ1/IQ2/IQ3 grids, re-coded (gguf_iq)
TABLED.update({t: v[3] for t, v in IQ_TYPES.items()})


class QuantFormatError(ValueError):
    """A quantized tensor whose scales are not finite: the file is corrupt."""


def quant_codes(data: np.ndarray, type_name: str, name: str = "tensor") -> QuantCodes | None:
    """A GGUF tensor's rows ([n, row bytes] uint8, as gguf's reader maps them) as codes and scales;
    None for a type kept in bf16 (F32, F16, BF16)."""
    if type_name not in TYPES:
        return None
    size, nbytes, extract = TYPES[type_name]
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, nbytes)
    q, d, s, d_off, s_off, bits, zero, group, block = extract(blocks)
    for h in (d, d_off):
        if h is not None and not np.isfinite(h).all():
            raise QuantFormatError(f"{name} ({type_name}) has scales that are not finite numbers: the file is corrupt")

    def rows(a):
        return None if a is None else np.ascontiguousarray(a).reshape(n, -1)
    return QuantCodes(rows(q), rows(d), rows(s), rows(d_off), rows(s_off), bits, zero, group, block, type_name.lower(),
                      TABLED.get(type_name))


class GGUFMatrix:
    """A quantized GGUF matrix by its Hugging Face name, read when the model is built, a run of rows at a time
    (quant_pack.quant_weight), so memory holds the repacked model and one run's temporaries, never a second
    copy. `heads`: undo llama.cpp's Q/K row interleave for that many heads (gguf_import.unpermute): within
    each head's rows, so a run holds whole heads (`row_unit`)."""

    def __init__(self, tensor, heads: int | None = None):
        self.tensor, self.heads = tensor, heads
        self.shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF shapes are reversed: [k, n]
        self.row_unit = self.shape[0] // heads if heads else 1

    def run(self, start: int, stop: int) -> QuantCodes:
        """Rows [start, stop) (multiples of `row_unit`) as codes, in Hugging Face row order."""
        c = quant_codes(self.tensor.row_range(start, stop), self.tensor.tensor_type.name, self.tensor.name)
        if self.heads is None:
            return c
        heads = (stop - start) // self.row_unit

        def rows(a):
            return None if a is None else \
                np.ascontiguousarray(a.reshape(heads, -1, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))
        return dataclasses.replace(c, codes=rows(c.codes), d=rows(c.d), s=rows(c.s), d_off=rows(c.d_off),
                                   s_off=rows(c.s_off))

    def codes(self) -> QuantCodes:
        return self.run(0, self.shape[0])

    def bf16(self):
        return self.codes().bf16()
