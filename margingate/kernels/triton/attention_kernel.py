"""The batch-invariant Triton attention over the paged KV cache.

One program per (row, query head), for prompt rows, decode rows and verifier rows alike. A row's
keys are [lo, length) of its request (lo = 0, or length - window for sliding-window layers), found
through its block table (position p: row p % BLOCK of block table[p // BLOCK]),
walked in CHUNK-key steps from lo and merged by online softmax in ascending order: a fixed
chunk size, not a fixed number of splits (SGLang's deterministic attention, vLLM's
batch_invariant.py), so the chunk edges, and with them the bits, are a function of the row's own
keys and length, never of the call's rows. Attention sinks (gpt-oss: a logit per query head in the
softmax's denominator) are merged last, as one more key whose value is zero: the order csrc/attention.cpp
keeps (docs/contract.md). The same rule as csrc/attention.cpp (chunks counted
from the row's first key), with its own chunk size and reduction shapes: not the same bits.
"""
from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64  # keys per online-softmax step
NUM_WARPS = 4


@triton.jit
def _chunk_update(q, k_ptrs, v_ptrs, keys, length, d_ok, m, den, acc, scale):
    """Merge one chunk of keys into the running max m, denominator den and output acc (fp32)."""
    k_ok = keys < length
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.where(k_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=0))  # finite: every chunk holds at least one key
    alpha = tl.exp(m - m_new)  # 0 on the first chunk (m = -inf)
    p = tl.exp(s - m_new)  # masked keys: exp(-inf) = 0
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    return m_new, den * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


# window is not specialized on (a layer's window, 0 or not, runs one binary); D is a model constant.
@triton.jit(do_not_specialize=["window"])
def attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, table_of_ptr, len_ptr, sinks_ptr, scale, window, D,
                     BLOCK, sq_n, sq_h, sk_b, sk_h, sk_l, so_n, so_h, st_t,
                     GROUP: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Row r, head h: softmax(q . k * scale) v over keys [lo, lengths[r]) of the row's block table, KV head
    h // GROUP. Strides: q / o [N, H, D], caches [blocks, Hkv, BLOCK, D] (the last dim contiguous), tables [T, W]."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    table = tables_ptr + tl.load(table_of_ptr + row).to(tl.int64) * st_t
    length = tl.load(len_ptr + row).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # branch-free: one type for lo
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + row * sq_n + head * sq_h + d, mask=d_ok, other=0.0).to(tl.float32)
    kv_head = (head // GROUP) * sk_h
    m = tl.full((), float("-inf"), tl.float32)
    den = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c0 in range(lo, length, CHUNK):
        keys = c0 + tl.arange(0, CHUNK)
        blocks = tl.load(table + keys // BLOCK, mask=keys < length, other=0).to(tl.int64)
        offs = blocks[:, None] * sk_b + kv_head + (keys % BLOCK).to(tl.int64)[:, None] * sk_l + d[None, :]
        m, den, acc = _chunk_update(q, k_ptr + offs, v_ptr + offs, keys, length, d_ok, m, den, acc, scale)
    if HAS_SINKS:  # the sink last: m' = max(m, sink), den' = den * exp(m - m') + exp(sink - m'), acc * exp(m - m')
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.exp(sink - m_new)
        acc = acc * alpha
    out = acc / tl.where(den > 0, den, 1.0)  # den = 0 only for an empty row (length 0): zeros, not NaN
    tl.store(o_ptr + row * so_n + head * so_h + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)
