"""Q4_K blocks from float weights, as llama.cpp's reference quantizer (`quantize_row_q4_K_ref`) writes them.

A block holds 256 weights (ggml-common.h's block_q4_K, 144 bytes): fp16 d, fp16 dmin, 12 bytes of
6-bit scales and mins packed, 128 bytes of 4-bit levels. Weight j of sub-block s (32 weights) is
d * scale_s * level_j - dmin * min_s. Each sub-block's scale and min come from `make_qkx2_quants`: a
weighted least-squares fit (weights av_x + |x|) over 21 candidate roundings, keeping the one of least
weighted squared error; then the eight scales and mins are rounded to 6 bits against d and dmin, and
the levels rounded again against what was stored.

Vectorized over sub-blocks: a chunk's sub-blocks are the columns of a [32, B] array, so every sum
runs down a column in the C loop's order and every product in its order (`_sum`). A column's result
depends on that column alone, never on where its row lies in the matrix: quantizing a matrix, or the
same matrix with its rows permuted (the GGUF export's Q/K order), gives the same blocks row for row.
Where the C code would wrap a negative 6-bit scale through uint8 we clamp it to 0.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K, SUB, BLOCK_BYTES = 256, 32, 144
NMAX, RMIN, RDELTA, NSTEP = 15, -1.0, 0.1, 20  # make_qkx2_quants(32, 15, ..., -1.f, 0.1f, 20, false)
CHUNK = 1024  # super-blocks per chunk: [32, 8192] float32 arrays of 1 MB (measured faster than smaller ones)
F = np.float32


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[n, k] float32 (k a multiple of 256) -> [n, k / 256 * 144] uint8 Q4_K blocks. Chunks run in
    threads (numpy's loops release the GIL); a chunk's blocks are the same whichever thread makes them."""
    n, k = w.shape
    if k % QK_K:
        raise ValueError(f"Q4_K needs rows of a multiple of {QK_K} weights, got {k}")
    x = np.ascontiguousarray(w, dtype=F).reshape(-1, QK_K)
    out = np.empty((x.shape[0], BLOCK_BYTES), np.uint8)

    def run(lo: int) -> None:
        out[lo:lo + CHUNK] = _blocks(x[lo:lo + CHUNK])

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(run, range(0, x.shape[0], CHUNK)))
    return out.reshape(n, -1)


def _sum(*factors: np.ndarray) -> np.ndarray:
    """Per column of [32, B] factors: the sum, in row order, of their product taken left to right."""
    return np.einsum(",".join(["ib"] * len(factors)) + "->b", *factors)


def _levels(x: np.ndarray, iscale: np.ndarray, lo: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """nearest_int(iscale * (x - lo)) clamped to 0..15 (np.rint rounds half to even, as nearest_int)."""
    q = np.subtract(x, lo, out=out)
    q *= iscale
    np.rint(q, out=q)
    return np.clip(q, 0, NMAX, out=q)


class _Fit:
    """make_qkx2_quants on every column of x [32, B], with scratch arrays reused by every candidate."""

    def __init__(self, x: np.ndarray):
        self.x, self.q, self.wq, self.d = x, np.empty_like(x), np.empty_like(x), np.empty_like(x)
        self.w = np.abs(x)
        self.w += np.sqrt(_sum(x, x) / F(SUB))  # av_x + |x|

    def error(self, scale: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """sum of w * (scale * q + lo - x)^2 down each column, for the levels last computed."""
        d = np.multiply(self.q, scale, out=self.d)
        d += lo
        d -= self.x
        return _sum(d, d, self.w)

    def run(self):
        """Each sub-block's scale and min (>= 0, subtracted), and the (iscale, offset) whose rounding gave
        the levels it chose (the levels a zero scale keeps)."""
        x, w = self.x, self.w
        sum_w, sum_x = np.add.reduce(w, axis=0), _sum(w, x)
        hi, lo = x.max(0), np.minimum(x.min(0), F(0))
        flat = hi == lo
        iscale = F(NMAX) / (hi - lo)
        _levels(x, iscale, lo, self.q)
        scale = F(1) / iscale
        # per column: the least error so far, its scale and offset, and the iscale and offset it rounded with
        best = np.stack([self.error(scale, lo), scale, lo, iscale, lo])
        for step in range(NSTEP + 1):
            lo = best[2]
            iscale = (F(RMIN) + F(RDELTA) * F(step) + F(NMAX)) / (hi - lo)
            q = _levels(x, iscale, lo, self.q)
            wq = np.multiply(w, q, out=self.wq)
            sum_l, sum_l2, sum_xl = np.add.reduce(wq, axis=0), _sum(wq, q), _sum(wq, x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0  # the offset may only lower the levels: refit the scale alone
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, F(0), this_min)
            mad = self.error(this_scale, this_min)
            better = (det > 0) & (mad < best[0])
            best = np.where(better, np.stack([mad, this_scale, this_min, iscale, lo]), best)
        return np.where(flat, F(0), best[1]), -best[2], (best[3], best[4]), flat


def _six_bits(values: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each super-block's eight values as 6-bit multiples of top / 63, and top / 63 in fp16."""
    inv = np.where(top > 0, F(63) / np.where(top > 0, top, F(1)), F(0))
    q = np.clip(np.rint(inv[:, None] * values), 0, 63).astype(np.uint8)
    return q, (top / F(63)).astype(np.float16)


def _blocks(superblocks: np.ndarray) -> np.ndarray:
    """[S, 256] float32 -> [S, 144] uint8: quantize_row_q4_K_ref on each row."""
    s = superblocks.shape[0]
    x = np.ascontiguousarray(superblocks.reshape(s * 8, SUB).T)  # [32, S * 8]: a sub-block per column
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale, the_min, chosen, flat = _Fit(x).run()
        scales, mins = scale.reshape(s, 8), the_min.reshape(s, 8)
        ls, d = _six_bits(scales, np.maximum(scales.max(1), F(0)))
        lm, dmin = _six_bits(mins, np.maximum(mins.max(1), F(0)))
        step = (d.astype(F)[:, None] * ls).reshape(-1)  # d * scale_s, as the dequantizer forms it
        offset = (dmin.astype(F)[:, None] * lm).reshape(-1)
        q = np.clip(np.rint((x + offset) / step), 0, NMAX)
        zero = np.flatnonzero(step == 0)  # these keep make_qkx2_quants' levels (a flat sub-block's: 0)
        if zero.size:
            kept = _levels(x[:, zero], chosen[0][zero], chosen[1][zero])
            q[:, zero] = np.where(flat[zero] | ~np.isfinite(kept), F(0), kept)
        q = q.astype(np.uint8)
    out = np.empty((s, BLOCK_BYTES), np.uint8)
    out[:, 0:2], out[:, 2:4] = d.view(np.uint8).reshape(s, 2), dmin.view(np.uint8).reshape(s, 2)
    out[:, 4:16] = _pack_scales(ls, lm)
    pairs = q.T.reshape(s, 4, 2, SUB)  # levels j and j + 32 of each 64 share a byte
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(s, 128)
    return out


def _pack_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """ggml's 12-byte layout: bytes 0-3 scales 0-3, 4-7 mins 0-3 (each topped with the high two bits of
    scale or min 4-7), 8-11 the low nibbles of scales and mins 4-7."""
    return np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                           (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=1)
