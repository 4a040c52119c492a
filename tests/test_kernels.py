"""The invariant kernels (`margingate.kernels.invariant`): correct, and row-independent.

Row-independence is the determinism contract at its root: a row's result must be bitwise
the same alone, among other rows, at any place among them, at any torch thread count.
Every check runs at 1, 2 and 4 threads (4 oversubscribes a 2-core machine), with row
counts just below, at and above the kernels' tile sizes (4- and 16-row tiles, 16-column panels,
32-k blocks, 32-key attention chunks), on the embedded model's own shapes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from margingate.kernels import invariant as K
from margingate.kernels import library
from margingate.kernels.packing import pack

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
# The order (csrc/contract.h, 1) is AMX's: per block of 32 k an even and an odd FMA chain from +0,
# their sum added to the accumulator. Every path the CPU has must give the scalar reference's bits.

PATH_SKIPS = {
    "amx": "this CPU has no AMX-BF16 tiles (amx_tile, amx_bf16 in lscpu) or the OS refused the tile state: "
           "the AMX path cannot run here (it runs on Sapphire Rapids and later Xeons)",
    "avx512bf16": "this CPU has no AVX512-BF16 (avx512_bf16, avx512bw): the VDPBF16PS path cannot run here",
    "avx512": "this CPU has no AVX-512 (avx512f): the AVX-512 path cannot run here",
    "avx2": "this CPU has no AVX2 + FMA",
}


@pytest.fixture(params=list(PATH_SKIPS), ids=lambda p: f"path-{p}")
def path(request):
    """Each linear path in turn; one the CPU lacks skips, saying why."""
    if request.param not in K.usable_paths("bf16"):
        pytest.skip(PATH_SKIPS[request.param])
    before = K.path_in_use("bf16")
    K.use_path(request.param)
    yield request.param
    K.use_path(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_rows_independent(name, dtype, threads):
    """x @ W.T + b: every row alone equals that row inside 1..33-row calls, bitwise (bf16 and
    fp32 activations, with a bias, odd shapes included)."""
    n_out, k = SHAPES[name]
    w, b = pack(randn(n_out, k, seed=1, scale=0.05)), randn(n_out, seed=2)
    x = randn(40, k, seed=3, dtype=dtype)
    alone = torch.cat([K.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
    assert alone.dtype == dtype
    assert_rows_independent(lambda part: K.linear(part, w, b), x, alone)


def test_linear_lm_head_rows_independent(llm, threads):
    """The largest shape (lm_head, 49152 x 576) on the model's own packed weights, without bias."""
    w = llm.model.own_weights.lm_head
    x = randn(9, w.k, seed=4)
    alone = torch.cat([K.linear(x[i:i + 1], w) for i in range(9)])
    for n in (2, 4, 5, 8, 9):
        assert torch.equal(K.linear(x[:n], w), alone[:n]) and torch.equal(K.linear(x[9 - n:], w), alone[9 - n:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_is_correct(dtype):
    """Against a float64 product: within fp32 accumulation error, then the output rounding."""
    w, b = randn(100, 1540, seed=5, scale=0.05), randn(100, seed=6)
    x = randn(6, 1540, seed=7, dtype=dtype)
    exact = x.double() @ w.double().T + b.double()
    got = K.linear(x, pack(w), b).double()
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7  # bf16 output: one rounding, relative
    assert ((got - exact).abs() <= tol * exact.abs().clamp_min(1.0)).all()


def amx_order_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The order as csrc/contract.h states it, written with PyTorch's fp32 ops, outside our C++: k
    padded to 32; per block, e and o start at 0 and take the even / odd products in ascending order
    (a product of two bf16 is exact in fp32, so `+` rounds once, as an FMA); acc = acc + (e + o).
    For inputs whose partial sums stay normal (no flush to zero to model)."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    xp, wp = torch.zeros(m, kp), torch.zeros(w.shape[0], kp)
    xp[:, :k], wp[:, :k] = x.float(), w.float()
    xs, ws = xp.view(m, 1, kp // 32, 16, 2), wp.view(1, -1, kp // 32, 16, 2)
    acc = torch.zeros(m, w.shape[0])
    for blk in range(kp // 32):
        e, o = torch.zeros_like(acc), torch.zeros_like(acc)
        for p in range(16):
            e = e + xs[:, :, blk, p, 0] * ws[:, :, blk, p, 0]
            o = o + xs[:, :, blk, p, 1] * ws[:, :, blk, p, 1]
        acc = acc + (e + o)
    return acc.to(torch.bfloat16)


@pytest.mark.parametrize("k", [64, 70, 576])
def test_bf16_linear_follows_its_documented_order(k, path):
    """Bitwise what the documented order gives, computed outside our C++, on every path this CPU
    has: the order is a specification, so every x86 CPU computes the same bits."""
    w, x = randn(29, k, seed=10, scale=0.05), randn(5, k, seed=11)
    assert torch.equal(bits(K.linear(x, pack(w))), bits(amx_order_reference(x, w)))


def edge_inputs(m: int, k: int, scale: float, seed: int) -> torch.Tensor:
    """Random values with exact zeros of both signs and, at tiny scales, bf16 denormals among them."""
    x = randn(m, k, seed=seed, scale=scale)
    x.view(-1)[::7] = 0.0
    x.view(-1)[3::11] = -0.0
    return x


#: (weight scale, input scale) per case; test_the_edge_cases_are_what_they_are_named checks each name
EDGES = {"normal": (1.0, 1.0), "denormal-products": (1e-20, 1e-20), "denormal-inputs": (1e-38, 1.0),
         "large": (1e18, 1e18)}
TINY = torch.finfo(torch.float32).tiny  # the least normal fp32 (bf16 has the same exponent range)


def test_the_edge_cases_are_what_they_are_named():
    """Each case of the next test holds what its name says, so that it can fail for that reason: normal
    inputs whose products are fp32 denormals; weights among which bf16 denormals; products near fp32's
    largest finite value."""
    def case(name):
        ws, xs = EDGES[name]
        w, x = edge_inputs(48, 64, ws, seed=48).double(), edge_inputs(5, 64, xs, seed=5).double()  # bf16, exactly
        return w, x, (x[:, None, :] * w[None]).abs()

    w, x, prods = case("denormal-products")
    nonzero = prods[prods > 0]
    assert (w[w != 0].abs() >= TINY).all() and (x[x != 0].abs() >= TINY).all()
    assert (nonzero < TINY).all()
    w, _, _ = case("denormal-inputs")
    assert ((w != 0) & (w.abs() < TINY)).sum() > 100
    _, _, prods = case("large")
    assert prods.max() > 1e35


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_path_equals_the_scalar_reference(path, edge, dtype):
    """Each path against the order one scalar FMA at a time (`linear_reference`), bitwise: tile edges
    in M (AMX's 16-row tiles, the FMA paths' 4-row tiles), N (16-column panels, 32-column tiles) and
    K (32-k blocks), with and without a bias; zeros of both signs; denormal products and inputs
    (flushed to zero on every path); values near fp32's range."""
    w_scale, x_scale = EDGES[edge]
    for (n, k) in [(16, 32), (17, 33), (33, 31), (48, 64), (29, 70), (96, 576)]:
        w = pack(edge_inputs(n, k, w_scale, seed=n))
        b = randn(n, seed=13, scale=w_scale)
        for m in (1, 3, 4, 5, 15, 16, 17, 33):
            x = edge_inputs(m, k, x_scale, seed=m).to(dtype)
            for bias in (None, b):
                want = K.linear_reference(x, w, bias)
                assert torch.equal(bits(K.linear(x, w, bias)), bits(want)), (path, n, k, m, bias is None)


@pytest.mark.parametrize("n, k", [(40, 70), (96, 576), (250, 1100)])
@pytest.mark.parametrize("threads", [1, 3], ids=lambda n: f"{n}-threads", indirect=True)
def test_no_blocking_choice_changes_a_bit(path, n, k, threads):
    """Every row count from 1 to 300 (one and several row jobs, full and partial register tiles,
    regrouped and in-register weights), bitwise the scalar reference's rows: how the linear blocks
    rows, panels and k slices, and how it splits them over threads, is free; the order is not."""
    w, b = pack(edge_inputs(n, k, 1.0, seed=n)), randn(n, seed=14)
    x = edge_inputs(300, k, 1.0, seed=k)
    want = bits(K.linear_reference(x, w, b))
    for m in range(0, 301):  # 0: a forward whose rows choose nothing still calls the head
        got = bits(K.linear(x[:m], w, b))
        assert torch.equal(got, want[:m]), (path, n, k, m)


def test_the_paths_agree_on_the_model_shapes(llm):
    """Every path this CPU has, against each other, on SmolLM2's own packed layer and head at 1-64 rows."""
    L = llm.model.own_weights.layers[0]
    before, outs = K.path_in_use("bf16"), {}
    try:
        for name in K.usable_paths("bf16"):
            K.use_path(name)
            outs[name] = [K.linear(randn(m, w.k, seed=m), w) for w in (L.qkv, L.gate_up, L.down_proj,
                                                                         llm.model.own_weights.lm_head)
                          for m in (1, 16, 64)]
    finally:
        K.use_path(before)
    first = next(iter(outs.values()))
    for name, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, first)), name


def test_packing_keeps_every_value():
    """Packed panels unpack to the matrix, and rows read from them (a tied embedding) are its rows."""
    w = randn(37, 70, seed=20)
    p = pack(w)
    assert p.data.shape == (3, 48, 16, 2) and torch.equal(p.unpack(), w)
    idx = torch.tensor([[0, 36], [17, 5]])
    assert torch.equal(p.rows(idx), w[idx])


def test_forcing_a_path_the_cpu_lacks_is_an_error():
    """MARGINGATE_FORCE_ISA: an unknown path, or one this CPU cannot run, is refused by name."""
    with pytest.raises(K.IsaError, match="'avx1' does not exist"):
        K.use_path("avx1")
    missing = [p for p in K.PATHS["bf16"] if p not in K.usable_paths("bf16")]
    if not missing:
        pytest.skip("this CPU runs every path")
    with pytest.raises(K.IsaError, match=f"'{missing[0]}' cannot run on this CPU"):
        K.use_path(missing[0])


# --- attention -----------------------------------------------------------------------------


def cache(slots=3, heads=3, length=80, dim=64, dtype=torch.bfloat16, block=16, seed=None):
    """One layer's paged cache holding `slots` requests of `length` positions (request s: block table s), and
    the same keys and values laid out contiguously ([slots, heads, length, dim]) for the oracles. With a seed,
    the requests' blocks lie in the pool in a random order."""
    k, v = randn(slots, heads, length, dim, seed=8, dtype=dtype), randn(slots, heads, length, dim, seed=9, dtype=dtype)
    per = length // block
    order = torch.arange(slots * per) if seed is None else torch.randperm(slots * per,
                                                                         generator=torch.Generator().manual_seed(seed))
    tables = order.view(slots, per)

    def pages(x):
        out = torch.empty(slots * per, heads, block, dim, dtype=dtype)
        out[tables.flatten()] = x.view(slots, heads, per, block, dim).transpose(1, 2).reshape(-1, heads, block, dim)
        return out

    none = torch.empty(0)
    return (pages(k), pages(v), none, none), tables, (k, v)


@pytest.mark.parametrize("window", [0, 40], ids=["full", "sliding-window"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attention_rows_independent(dtype, window, threads):
    """Rows over prefixes of 1..80 keys (chunk edges 31, 32, 33, 64, 65 included) in several
    slots, over all their keys or a sliding window's: each row alone equals that row inside any
    call, bitwise."""
    kv, tables, _ = cache()
    lengths = torch.tensor([1, 31, 32, 33, 64, 65, 80, 2, 17, 48, 63, 79, 5, 40, 66, 30, 8, 50, 70, 12] * 2)
    slots = torch.arange(lengths.shape[0]) % 3
    q = randn(lengths.shape[0], 9, 64, seed=10, dtype=dtype)
    scale = 0.125
    alone = torch.cat([K.attention(q[i:i + 1], kv, tables, slots[i:i + 1], lengths[i:i + 1], scale, window=window)
                       for i in range(q.shape[0])])
    for n in ROW_COUNTS:
        for start in (0, q.shape[0] - n):
            got = K.attention(q[start:start + n], kv, tables, slots[start:start + n], lengths[start:start + n], scale,
                              window=window)
            assert torch.equal(got, alone[start:start + n]), f"{n} rows from row {start}"


@pytest.mark.parametrize("window", [0, 33], ids=["full", "sliding-window"])
def test_attention_is_correct(window):
    """Against SDPA in float64 over the same prefix, or its last `window` keys (grouped query heads)."""
    kv, tables, (k, v) = cache(dtype=torch.float32, seed=1)
    q = randn(6, 9, 64, seed=11, dtype=torch.float32)
    lengths, slots = torch.tensor([1, 31, 32, 33, 65, 80]), torch.tensor([0, 1, 2, 0, 1, 2])
    got = K.attention(q, kv, tables, slots, lengths, 0.125, window=window)
    for i in range(6):
        s, n = int(slots[i]), int(lengths[i])
        lo = max(0, n - window) if window else 0
        want = F.scaled_dot_product_attention(q[i].double().view(3, 3, 64), k[s, :, lo:n].double(),
                                              v[s, :, lo:n].double(), scale=0.125).reshape(9, 64)
        assert (got[i].double() - want).abs().max() < 1e-5, f"row {i} over {n} keys"


def test_attention_aligned_to_a_padded_batch():
    """`fast`'s batched rows lay their key chunks so that one ends at the batch's padded length.
    A multiple of the chunk is the exact layout (same bits); other alignments stay as correct
    as the exact layout (fp32 oracle) but move the merge points, and with them the bits: the
    batch variance `fast` keeps on purpose."""
    kv, tables, _ = cache(dtype=torch.float32)
    q = randn(6, 9, 64, seed=11, dtype=torch.float32)
    lengths, slots = torch.tensor([33, 40, 65, 70, 79, 80]), torch.tensor([0, 1, 2, 0, 1, 2])
    exact = K.attention(q, kv, tables, slots, lengths, 0.125)
    assert torch.equal(K.attention(q, kv, tables, slots, lengths, 0.125, torch.full((6,), 64)), exact)
    changed = 0
    for align in (70, 75, 80, 81):
        got = K.attention(q, kv, tables, slots, lengths, 0.125, torch.full((6,), align))
        assert (got - exact).abs().max() < 1e-5
        changed += int(not torch.equal(got, exact))
    assert changed > 0


def test_attention_refuses_bad_lengths_and_tables():
    kv, tables, _ = cache()
    q = randn(1, 9, 64)
    with pytest.raises(RuntimeError, match="reaches position 80, beyond its table's 5 blocks"):
        K.attention(q, kv, tables, torch.tensor([0]), torch.tensor([81]), 0.125)
    with pytest.raises(RuntimeError, match="names table 3 of 3"):
        K.attention(q, kv, tables, torch.tensor([3]), torch.tensor([4]), 0.125)
    bad = tables.clone()
    bad[1, 2] = 15
    with pytest.raises(RuntimeError, match="table 1 entry 2 is block 15, outside the pool's 15"):
        K.attention(q, kv, bad, torch.tensor([1]), torch.tensor([33]), 0.125)
    bad[1, 2] = -1  # past a row's length, an entry is never read
    K.attention(q, kv, bad, torch.tensor([1]), torch.tensor([32]), 0.125)


@pytest.mark.parametrize("window", [0, 40], ids=["full", "sliding-window"])
@pytest.mark.parametrize("block", [16, 32, 12])
def test_attention_reads_keys_in_position_order_wherever_their_blocks_lie(block, window, threads):
    """The same requests with their blocks contiguous, shuffled through the pool, or in blocks of another
    size (32, or 12: chunk edges inside blocks): every row's output is the same bits."""
    lengths = torch.tensor([1, 5, 16, 17, 31, 32, 33, 64, 65, 80, 7, 48])
    slots = torch.arange(12) % 3
    q = randn(12, 9, 64, seed=10)
    want = K.attention(q, *cache(length=96)[:2], slots, lengths, 0.125, window=window)
    for seed in (None, 1, 2):
        kv, tables, _ = cache(length=96, block=block, seed=seed)
        assert torch.equal(K.attention(q, kv, tables, slots, lengths, 0.125, window=window), want), (block, seed)


# --- norms and activation --------------------------------------------------------------------


@pytest.mark.parametrize("unit_offset", [0, 1, 2], ids=["llama-norm", "gemma-norm", "gpt-oss-norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rmsnorm_rows_independent_and_correct(dtype, unit_offset, threads):
    """Per-row kernel: row-independent bitwise, and within one rounding of the library's (a width
    with a tail past the last 8 lanes included). gpt-oss's (mode 2): the fp32 product rounded once, which is
    the library's bits exactly in bf16 (the sum of squares aside, the same two fp32 products)."""
    for d in (576, 260):
        x, w = randn(40, d, seed=12, dtype=dtype), randn(d, seed=13)
        alone = torch.cat([K.rmsnorm(x[i:i + 1], w, 1e-5, unit_offset) for i in range(40)])
        assert_rows_independent(lambda part: K.rmsnorm(part, w, 1e-5, unit_offset), x, alone)
        ref = library.rmsnorm(x.double(), w.double(), 1e-5, unit_offset)
        assert ((alone.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all()
        if unit_offset == 2 and dtype == torch.bfloat16:  # one rounding, not the Llama family's two
            rounded_first = K.rmsnorm(x, w, 1e-5, 0)
            assert (alone.double() - ref).abs().mean() < (rounded_first.double() - ref).abs().mean()


@pytest.mark.parametrize("act", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gated_activations_rows_independent_and_correct(dtype, act, threads):
    """act(gate) * up: row-independent bitwise, and within one rounding of the library's in float64
    (an intermediate width with a tail included; gates up to about +-12 reach both saturations)."""
    for inter in (1536, 1030):
        gu = randn(40, 2 * inter, seed=14, dtype=dtype, scale=3.0)
        alone = torch.cat([getattr(K, act)(gu[i:i + 1]) for i in range(40)])
        assert_rows_independent(getattr(K, act), gu, alone)
        ref = getattr(library, act)(gu.double())
        assert ((alone.double() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-6).all()


def test_the_harness_catches_a_library_kernel():
    """Inverse control: the same check on the library's fp32 GEMM (MKL picks its algorithm by
    the number of rows) finds rows that change with the batch, so the check can fail."""
    w, x = randn(960, 576, seed=15, dtype=torch.float32), randn(40, 576, seed=16, dtype=torch.float32)
    alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(40)])
    with pytest.raises(AssertionError, match="rows from row"):
        assert_rows_independent(lambda part: F.linear(part, w), x, alone)
