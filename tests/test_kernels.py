"""The invariant kernels (`margingate.kernels.invariant`): correct, and row-independent.

Row-independence is the determinism contract at its root: a row's result must be bitwise
the same alone, among other rows, at any place among them, at any torch thread count.
Every check runs at 1, 2 and 4 threads (4 oversubscribes a 2-core machine), with row
counts just below, at and above the kernels' tile sizes (4-row tiles, 12-column blocks,
32-key attention chunks), on the embedded model's own shapes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from margingate.kernels import invariant as K
from margingate.kernels import library

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33)
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "down_proj": (576, 1536), "odd": (29, 70)}


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}-threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def randn(*shape, seed=0, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_rows_independent(fn, x: torch.Tensor, alone: torch.Tensor) -> None:
    """fn over every window of `x` (each size in ROW_COUNTS, at the start, middle and end)
    equals the rows computed alone, bitwise."""
    total = x.shape[0]
    for n in ROW_COUNTS:
        for start in sorted({0, (total - n) // 2, total - n}):
            got = fn(x[start:start + n])
            assert torch.equal(got, alone[start:start + n]), f"{n} rows from row {start}"


# --- linear ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_rows_independent(name, dtype, threads):
    """x @ W.T + b: every row alone equals that row inside 1..33-row calls, bitwise (bf16 and
    fp32 activations, with a bias, odd shapes included)."""
    n_out, k = SHAPES[name]
    w, b = randn(n_out, k, seed=1, scale=0.05), randn(n_out, seed=2)
    x = randn(40, k, seed=3, dtype=dtype)
    alone = torch.cat([K.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
    assert alone.dtype == dtype
    assert_rows_independent(lambda part: K.linear(part, w, b), x, alone)


def test_linear_lm_head_rows_independent(llm, threads):
    """The largest shape (lm_head, 49152 x 576) on the model's own weights, without bias."""
    w = llm.model.weights(torch.bfloat16).lm_head
    x = randn(9, w.shape[1], seed=4)
    alone = torch.cat([K.linear(x[i:i + 1], w) for i in range(9)])
    for n in (2, 4, 5, 8, 9):
        assert torch.equal(K.linear(x[:n], w), alone[:n]) and torch.equal(K.linear(x[9 - n:], w), alone[9 - n:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_is_correct(dtype):
    """Against a float64 product: within fp32 accumulation error, then the output rounding."""
    w, b = randn(100, 1540, seed=5, scale=0.05), randn(100, seed=6)
    x = randn(6, 1540, seed=7, dtype=dtype)
    exact = x.double() @ w.double().T + b.double()
    got = K.linear(x, w, b).double()
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7  # bf16 output: one rounding, relative
    assert ((got - exact).abs() <= tol * exact.abs().clamp_min(1.0)).all()


# --- attention -----------------------------------------------------------------------------


def cache(slots=3, heads=3, length=80, dim=64, dtype=torch.bfloat16):
    return randn(slots, heads, length, dim, seed=8, dtype=dtype), randn(slots, heads, length, dim, seed=9, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attention_rows_independent(dtype, threads):
    """Rows over prefixes of 1..80 keys (chunk edges 31, 32, 33, 64, 65 included) in several
    slots: each row alone equals that row inside any call, bitwise."""
    k, v = cache()
    lengths = torch.tensor([1, 31, 32, 33, 64, 65, 80, 2, 17, 48, 63, 79, 5, 40, 66, 30, 8, 50, 70, 12] * 2)
    slots = torch.arange(lengths.shape[0]) % 3
    q = randn(lengths.shape[0], 9, 64, seed=10, dtype=dtype)
    scale = 0.125
    alone = torch.cat([K.attention(q[i:i + 1], k, v, slots[i:i + 1], lengths[i:i + 1], scale)
                       for i in range(q.shape[0])])
    for n in ROW_COUNTS:
        for start in (0, q.shape[0] - n):
            got = K.attention(q[start:start + n], k, v, slots[start:start + n], lengths[start:start + n], scale)
            assert torch.equal(got, alone[start:start + n]), f"{n} rows from row {start}"


def test_attention_is_correct():
    """Against SDPA in float64 over the same prefix (grouped query heads)."""
    k, v = cache(dtype=torch.float32)
    q = randn(6, 9, 64, seed=11, dtype=torch.float32)
    lengths, slots = torch.tensor([1, 31, 32, 33, 65, 80]), torch.tensor([0, 1, 2, 0, 1, 2])
    got = K.attention(q, k, v, slots, lengths, 0.125)
    for i in range(6):
        s, n = int(slots[i]), int(lengths[i])
        want = F.scaled_dot_product_attention(q[i].double().view(3, 3, 64), k[s, :, :n].double(),
                                              v[s, :, :n].double(), scale=0.125).reshape(9, 64)
        assert (got[i].double() - want).abs().max() < 1e-5, f"row {i} over {n} keys"


def test_attention_refuses_bad_lengths():
    k, v = cache()
    q = randn(1, 9, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        K.attention(q, k, v, torch.tensor([0]), torch.tensor([81]), 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        K.attention(q, k, v, torch.tensor([3]), torch.tensor([4]), 0.125)


# --- norms and activation --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rmsnorm_and_silu_rows_independent_and_correct(dtype, threads):
    """Per-row kernels: row-independent bitwise, and within one rounding of the library's."""
    x, w = randn(40, 576, seed=12, dtype=dtype), randn(576, seed=13)
    alone = torch.cat([K.rmsnorm(x[i:i + 1], w, 1e-5) for i in range(40)])
    assert_rows_independent(lambda part: K.rmsnorm(part, w, 1e-5), x, alone)
    ref = library.rmsnorm(x, w.to(dtype), 1e-5).double()
    assert ((alone.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all()

    gu = randn(40, 2 * 1536, seed=14, dtype=dtype, scale=3.0)
    alone = torch.cat([K.silu_mul(gu[i:i + 1]) for i in range(40)])
    assert_rows_independent(K.silu_mul, gu, alone)
    ref = library.silu_mul(gu.double())
    assert ((alone.double() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-6).all()


def test_the_harness_catches_a_library_kernel():
    """Inverse control: the same check on the library's fp32 GEMM (MKL picks its algorithm by
    the number of rows) finds rows that change with the batch, so the check can fail."""
    w, x = randn(960, 576, seed=15, dtype=torch.float32), randn(40, 576, seed=16, dtype=torch.float32)
    alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(40)])
    with pytest.raises(AssertionError, match="rows from row"):
        assert_rows_independent(lambda part: F.linear(part, w), x, alone)
