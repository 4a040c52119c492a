"""The batch-invariant Triton linear: y = x @ w.T (+ bias), fp32 accumulation.

Invariance comes from having one schedule for a row at every M (vLLM's batch_invariant.py,
thinking-machines-lab/batch_invariant_ops): one tile configuration (TILE) whatever the shape,
no split-K, and K walked in BLOCK_K steps from 0 upwards into one fp32 accumulator. An output
element is computed by the tile that holds it, and a tile's arithmetic does not depend on
which program runs it or how many programs there are (persistent grid), so row r gets the
same bits in an M=1 call as in an M=4096 one.
"""
from __future__ import annotations

import triton
import triton.language as tl

# The one tile configuration (bf16 on H100 in the recipe above). BLOCK_*, num_warps decide the
# MMA sequence and so the bits; num_stages only the pipelining. GROUP_M: the L2-friendly tile
# order, which programs compute which tile, not how.
TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
NUM_WARPS = 8
NUM_STAGES = {"bf16": 3, "fp32": 2}  # fp32 tiles take twice the shared memory per stage


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile index -> (tile row, tile column), grouped GROUP_M tile rows at a time."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _tile_product(x_ptr, w_ptr, rm, rn, M, N, K, sxm, sxk, swk, swn, DOT_FP32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile's fp32 sums over K, BLOCK_K at a time from k = 0: the only reduction order."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm < M
    col_ok = rn < N
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + k[None, :] * sxk, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(w_ptr + k[:, None] * swk + rn[None, :] * swn, mask=(k < K)[:, None] & col_ok[None, :], other=0.0)
        if DOT_FP32:  # fp32 operands (the interpreter's, or fp32 activations): exact products, no TF32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:  # bf16 x bf16 on tensor cores, fp32 accumulation
            acc = tl.dot(a, b, acc)
    return acc


# M is not specialized on (Triton would compile M == 1 and M % 16 == 0 apart): one binary for every M.
@triton.jit(do_not_specialize=["M"])
def linear_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, sxm, sxk, swk, swn, som, son,
                  HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent: program p computes tiles p, p + NUM_PROGRAMS, ... of the [M, N] output."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        tm, tn = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        rm = (tm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: vocab x hidden heads exceed 2^31
        rn = (tn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = _tile_product(x_ptr, w_ptr, rm, rn, M, N, K, sxm, sxk, swk, swn, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_BIAS:  # added to the fp32 sum, one rounding at the store
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tl.store(o_ptr + rm[:, None] * som + rn[None, :] * son, acc.to(o_ptr.dtype.element_ty), mask=mask)
