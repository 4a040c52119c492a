"""gpt-oss's attention sinks in the compiled attention (csrc/attention.cpp; the order: docs/contract.md). The
Triton kernel's: tests/test_triton_kernels.py."""
from __future__ import annotations

import pytest
import torch
from test_kernels import K, cache, randn


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_attention_sinks_join_the_denominator(threads):
    """gpt-oss's sinks (a logit per query head in the softmax's denominator, no value), at 1, 2 and 4 threads:
    against float64 with the sink joined and dropped as transformers does, and every row alone equals that row
    inside the call, bitwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_sinks()
    finally:
        torch.set_num_threads(before)


def check_sinks():
    kv, tables, (k, v) = cache(dtype=torch.float32, seed=1)
    q = randn(6, 9, 64, seed=11, dtype=torch.float32)
    sinks = randn(9, seed=12, dtype=torch.float32) * 3
    lengths, slots = torch.tensor([1, 31, 32, 33, 65, 80]), torch.tensor([0, 1, 2, 0, 1, 2])
    got = K.attention(q, kv, tables, slots, lengths, 0.125, window=40, sinks=sinks)
    for i in range(6):
        s, n = int(slots[i]), int(lengths[i])
        keys = k[s, :, max(0, n - 40):n].double().repeat_interleave(3, dim=0)
        vals = v[s, :, max(0, n - 40):n].double().repeat_interleave(3, dim=0)
        scores = torch.einsum("hd,hkd->hk", q[i].double(), keys) * 0.125
        p = torch.cat((scores, sinks.double()[:, None]), dim=-1).softmax(-1)[:, :-1]
        assert (got[i].double() - torch.einsum("hk,hkd->hd", p, vals)).abs().max() < 1e-5, f"row {i} over {n} keys"
        alone = K.attention(q[i:i + 1], kv, tables, slots[i:i + 1], lengths[i:i + 1], 0.125, window=40, sinks=sinks)
        assert torch.equal(alone, got[i:i + 1])
    assert (got - K.attention(q, kv, tables, slots, lengths, 0.125, window=40)).abs().max() > 1e-3
