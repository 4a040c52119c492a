"""Row-wise Triton kernels: RMSNorm, SiLU / GELU-tanh x up, log-softmax.

One program per row for the reductions, walking the row in BLOCK-wide steps from column 0
with one fp32 partial per lane, the lanes summed once at the end: the order depends on the
row's width alone, never on how many rows came with it. The activations have no reduction;
each element is computed the same way wherever it sits.

Roundings to bf16 that Hugging Face's modules make mid-expression are made here by
`round_bf16` on fp32 values (bit arithmetic, round to nearest even, as a cast does), so the
same code is exact under Triton's CPU interpreter, whose own fp32 -> bf16 cast truncates.
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024  # columns per step: fixed, so a row's reduction order is a function of its width
NUM_WARPS = 4


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, o_ptr, D, eps, UNIT_OFFSET: tl.constexpr, ROUND_H: tl.constexpr,
                   BLOCK: tl.constexpr):
    """h = x * rsqrt(mean(x^2) + eps) in fp32; Llama: w * bf16(h) (ROUND_H for bf16 rows);
    Gemma (UNIT_OFFSET): h * (1 + w) in fp32. The caller rounds once more to the row's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, D, BLOCK):
        x = tl.load(x_ptr + row * D + c0 + cols, mask=c0 + cols < D, other=0.0).to(tl.float32)
        squares += x * x
    inv = tl.rsqrt(tl.sum(squares, axis=0) / D + eps)
    for c0 in range(0, D, BLOCK):
        mask = c0 + cols < D
        h = tl.load(x_ptr + row * D + c0 + cols, mask=mask, other=0.0).to(tl.float32) * inv
        w = tl.load(w_ptr + c0 + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            y = h * (1.0 + w)
        elif ROUND_H:
            y = w * round_bf16(h)
        else:
            y = w * h
        tl.store(o_ptr + row * D + c0 + cols, y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu(g):
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _gelu_tanh(g):
    # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3): no tanh needed,
    # and accurate where tanh(u) is near -1 (csrc/rowwise.cpp computes it the same way).
    return g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))


@triton.jit
def act_mul_kernel(gu_ptr, o_ptr, inter, GELU: tl.constexpr, ROUND_ACT: tl.constexpr, BLOCK: tl.constexpr):
    """out = act(gate) * up for gate_up [rows, 2 * inter]; grid (rows, cdiv(inter, BLOCK)).
    bf16 rows round act(gate) first (ROUND_ACT), as `F.silu(gate) * up` does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        a = _gelu_tanh(g)
    else:
        a = _silu(g)
    if ROUND_ACT:
        a = round_bf16(a)
    tl.store(o_ptr + row * inter + cols, (a * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_clamped_kernel(gu_ptr, o_ptr, inter, alpha, limit, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """gpt-oss's experts: out = (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha * g)), g = min(gate, limit),
    for gate_up [rows, 2 * inter]; bf16 rows round each op (ROUND), as csrc/rowwise.cpp and transformers do."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.minimum(tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32), limit)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    z = alpha * g
    if ROUND:
        z = round_bf16(z)
    sig = 1.0 / (1.0 + tl.exp(-z))
    if ROUND:
        sig = round_bf16(sig)
    glu = g * sig
    up1 = u + 1.0
    if ROUND:
        glu, up1 = round_bf16(glu), round_bf16(up1)
    tl.store(o_ptr + row * inter + cols, (up1 * glu).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def log_softmax_kernel(x_ptr, o_ptr, V, BLOCK: tl.constexpr):
    """out = x - max - log(sum(exp(x - max))) of one fp32 row: max, then the per-lane sums of
    exp, then their one sum (the max is exact in any order; the sums follow the fixed walk)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    peak = tl.full((BLOCK,), float("-inf"), tl.float32)
    for c0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * V + c0 + cols, mask=c0 + cols < V, other=float("-inf"))
        peak = tl.maximum(peak, x)
    m = tl.max(peak, axis=0)
    sums = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, V, BLOCK):
        x = tl.load(x_ptr + row * V + c0 + cols, mask=c0 + cols < V, other=float("-inf"))
        sums += tl.exp(x - m)
    lse = m + tl.log(tl.sum(sums, axis=0))
    for c0 in range(0, V, BLOCK):
        mask = c0 + cols < V
        x = tl.load(x_ptr + row * V + c0 + cols, mask=mask, other=0.0)
        tl.store(o_ptr + row * V + c0 + cols, x - lse, mask=mask)
