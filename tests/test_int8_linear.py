"""The integer-exact contract for quantized matrices (issue 45; csrc/contract.h, 5).

x's rows are quantized to int8 by the row alone, integer sums are exact, and one float epilogue per
(row, column) follows a stated order. Here the contract is written a second time, in numpy, from the
GGUF codes and scales (not from our packed layout), and every path must give its bits: the C++ scalar
reference, and the vector path this CPU runs, at every row count and thread count.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from margingate.kernels import invariant as K
from margingate.kernels.quant_pack import TABLES, QuantCodes, quant_weight
from margingate.models.gguf_quant import TYPES, quant_codes

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_quantized import random_tensor, same_bits  # noqa: E402

FLT_MIN = np.float32(np.finfo(np.float32).tiny)


def numpy_quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """contract.h, 5a: q [M, K] int32, scale [M, K / block] fp32 (K a multiple of block)."""
    v = x.astype(np.float32).reshape(x.shape[0], -1, block)
    v = np.where(np.abs(v) < FLT_MIN, np.float32(0), v)
    finite = np.isfinite(v).all(axis=-1)
    amax = np.abs(np.where(np.isfinite(v), v, 0)).max(axis=-1).astype(np.float32)
    safe = np.where(amax > 0, amax, np.float32(1))
    r = (np.float32(127) / safe).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.clip(np.rint((v * r[..., None]).astype(np.float32)), -127, 127)
    q = np.where((finite & (amax > 0))[..., None], q, 0).astype(np.int32)
    scale = (amax / np.float32(127)).astype(np.float32)
    scale = np.where(scale < FLT_MIN, np.float32(0), scale)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    return q.reshape(x.shape[0], -1), scale


def numpy_linear(x: np.ndarray, c: QuantCodes) -> np.ndarray:
    """contract.h, 5b and 5c from the codes: int64 sums (exact), then the fp32 epilogue step by step."""
    q, scale = numpy_quantize(x, c.block)
    m, (n, k) = x.shape[0], c.codes.shape
    groups, per = k // c.group, c.block // c.group
    w = c.values().astype(np.int64)
    isum = np.einsum("mgj,ngj->mng", q.reshape(m, groups, c.group).astype(np.int64), w.reshape(n, groups, c.group))
    xsum = q.reshape(m, groups, c.group).sum(-1).astype(np.int64)[:, None, :]
    s = np.ones((n, groups), np.int64) if c.s is None else c.s.astype(np.int64)
    s_off = np.ones((n, groups), np.int64) if c.s_off is None else c.s_off.astype(np.int64)
    S = (s[None] * isum).reshape(m, n, -1, per).sum(-1)
    M = (s_off[None] * xsum).reshape(m, n, -1, per).sum(-1)
    assert np.abs(S).max() < 2 ** 31 and np.abs(M).max() < 2 ** 31
    acc = np.zeros((m, n), np.float32)
    for b in range(k // c.block):
        dd = (scale[:, b, None] * (c.d[None, :, b].astype(np.float32) * c.unit)).astype(np.float32)
        acc = (acc + (S[..., b].astype(np.float32) * dd).astype(np.float32)).astype(np.float32)
        if c.d_off is not None:
            do = (scale[:, b, None] * c.d_off[None, :, b].astype(np.float32)).astype(np.float32)
            acc = (acc + (M[..., b].astype(np.float32) * do).astype(np.float32)).astype(np.float32)
    return acc


def bf16_rows(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g) * 2)).to(torch.bfloat16)


def test_the_activation_quantizer_follows_the_contract_at_its_edges():
    """Zeros, an infinity, a NaN, denormals, values at .5 after scaling (ties to even), and the -127/127
    edges: the C++ quantizer equals the numpy statement of the contract, in bf16 and fp32."""
    rows = np.zeros((8, 64), np.float32)
    rows[0] = np.linspace(-3, 3, 64)
    rows[1, 5] = np.inf                     # block 0: q = 0, scale NaN; block 1 untouched
    rows[1, 40] = 2.0
    rows[2, 7] = np.nan
    rows[3, :4] = [1e-40, -1e-39, 0.5, -0.25]   # fp32 denormals count as 0
    rows[4, :4] = [127.0, 0.5, 1.5, -2.5]       # amax 127: scale 1, q = rne(x): 0, 2, -2
    rows[5, :3] = [-254.0, 1.0, 3.0]            # x * (127/254) = 0.5, 1.5: ties to even
    rows[6] = -np.abs(np.linspace(1, 9, 64))    # the largest magnitude is negative: -127
    # row 7: all zero: q = 0, scale 0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(rows).to(dtype)
        q, scale, sum16 = K.quantize_rows_int8(x, 32)
        want_q, want_scale = numpy_quantize(x.float().numpy(), 32)
        assert np.array_equal(q.numpy().astype(np.int32), want_q), dtype
        assert np.array_equal(scale.numpy(), want_scale, equal_nan=True), dtype
        assert np.array_equal(sum16.numpy(), want_q.reshape(8, -1, 16).sum(-1))
    q, scale, _ = K.quantize_rows_int8(torch.from_numpy(rows), 32)
    assert q[4, :4].tolist() == [127, 0, 2, -2] and q[5, :3].tolist() == [-127, 0, 2]
    assert q[6].min() == -127 and q.abs().max() == 127
    assert scale[1, 0].isnan() and q[1, :32].abs().sum() == 0 and scale[1, 1] > 0
    assert scale[7].tolist() == [0.0, 0.0] and q[3, :2].tolist() == [0, 0]


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_every_format_gives_the_numpy_statement_of_the_contract_bit_for_bit(type_name, int8_path):
    """The C++ scalar reference and each vector path against numpy, from the GGUF codes themselves
    (37 rows: two AMX tiles and a tail)."""
    c = quant_codes(random_tensor(type_name, 32, 512, seed=3), type_name)
    w = quant_weight([c], "int8")
    x = bf16_rows(37, 512, seed=len(type_name))
    want = torch.from_numpy(numpy_linear(x.float().numpy(), c)).to(torch.bfloat16)
    assert same_bits(K.linear_reference(x, w), want)
    assert same_bits(K.linear(x, w), want)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_1"])
def test_each_row_has_the_same_bits_at_every_row_count_and_thread_count(type_name, int8_path):
    """Rows 1..300 through the vector path equal the scalar reference's; a row alone equals it inside
    any batch, at 1 thread and at all cores (the contract: vectorized across rows, never across k)."""
    c = quant_codes(random_tensor(type_name, 40, 256, seed=5), type_name)
    w = quant_weight([c], "int8")
    x = bf16_rows(300, 256, seed=7)
    want = K.linear_reference(x, w)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 63, 64, 65, 129, 300):
                assert same_bits(K.linear(x[:m], w), want[:m]), (t, m)
            assert same_bits(K.linear(x[150:151], w), want[150:151])
    finally:
        torch.set_num_threads(threads)


def test_codes_and_scales_at_their_extremes_do_not_saturate(int8_path):
    """Every code at its largest (2 to 6 bits), at -128 (8 bits) or at the table's -127, scales of -128,
    and x at +-127: the integer sums must come out exact (numpy's int64 against our int16/int32 steps)."""
    n, k = 16, 256
    for bits, zero, group, block, table in ((4, 0, 32, 256, None), (5, 0, 32, 256, None), (6, 32, 16, 256, None),
                                            (8, 0, 32, 32, None), (6, 0, 16, 256, None), (2, 0, 16, 256, None),
                                            (3, 0, 16, 256, None), (4, 0, 32, 256, "iq4nl"), (4, 0, 32, 32, "iq4nl"),
                                            (3, 0, 16, 256, "iq2"), (4, 0, 32, 256, "iq3xxs")):
        top = -128 if bits == 8 else int(np.abs(TABLES[table][1]).argmax()) if table else (1 << bits) - 1
        codes = np.full((n, k), top, np.int8 if bits == 8 else np.uint8)
        has_s = group != block
        s = np.full((n, k // group), -128 if bits in (2, 3, 4, 6) else 63, np.int8) if has_s else None
        d = np.full((n, k // block), 0.5, np.float16)
        c = QuantCodes(codes, d, s, None, None, bits, zero, group, block, f"extreme-{bits}", table)
        x = torch.full((19, k), 1.0, dtype=torch.bfloat16)  # 16 rows of a tile and 3 of a tail
        x[1::3] = -1.0
        x[2::3, ::2] = -1.0
        w = quant_weight([c], "int8")
        want = torch.from_numpy(numpy_linear(x.float().numpy(), c)).to(torch.bfloat16)
        assert same_bits(K.linear(x, w), want), bits
        assert same_bits(K.linear_reference(x, w), want), bits


def test_a_matrix_of_two_formats_quantizes_x_once_per_block_size():
    """A fused q|k|v of Q8_0 rows (blocks of 32) and Q4_K rows (256): each part's rows follow its own
    block's activation scales, as numpy computes them part by part."""
    a = quant_codes(random_tensor("Q8_0", 32, 512, seed=1), "Q8_0")
    b = quant_codes(random_tensor("Q4_K", 16, 512, seed=2), "Q4_K")
    w = quant_weight([a, b], "int8")
    x = bf16_rows(6, 512, seed=11)
    want = np.concatenate([numpy_linear(x.float().numpy(), a), numpy_linear(x.float().numpy(), b)], axis=1)
    assert same_bits(K.linear(x, w), torch.from_numpy(want).to(torch.bfloat16))


def test_the_int8_paths_are_proven_at_load_and_a_faulty_one_is_refused():
    """Every path this CPU runs passed its proof against the scalar reference, and the fastest is in use.
    With one output bit flipped in a proof (MARGINGATE_PROOF_FAULT, in a fresh process) that path is
    refused by name and the next one runs; with every path faulted the linear stops, naming each."""
    import subprocess

    proofs = K.proofs("int8")
    assert [p["path"] for p in proofs] == list(K.PATHS["int8"])
    passed = [p["path"] for p in proofs if p["status"] == "passed"]
    assert "int8-avx2" in passed and all(p["status"] in ("passed", "cpu lacks it") for p in proofs), proofs
    assert K.path_in_use("int8") == passed[0] and proofs[K.PATHS["int8"].index(passed[0])]["detail"] == ""
    code = ("import torch, sys; sys.path.insert(0, 'tests'); from margingate.kernels import invariant as K; "
            "from margingate.kernels.quant_pack import quant_weight; from test_quantized import random_tensor; "
            "from margingate.models.gguf_quant import quant_codes; "
            "print(*[p['path'] + '=' + p['status'] for p in K.proofs('int8')]); "
            "w = quant_weight([quant_codes(random_tensor('Q4_0', 16, 64), 'Q4_0')], 'int8'); "
            "K.linear(torch.ones(1, 64, dtype=torch.bfloat16), w); print('in use', K.path_in_use('int8'))")

    def run(fault: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**__import__("os").environ, "MARGINGATE_PROOF_FAULT": fault},
                              cwd=__file__.rsplit("/", 2)[0])

    one = run(passed[0])
    assert f"{passed[0]}=failed" in one.stdout, one.stdout + one.stderr
    if len(passed) > 1:
        assert one.returncode == 0 and f"in use {passed[1]}" in one.stdout, one.stdout + one.stderr
    every = run(",".join(passed))
    assert every.returncode != 0 and "no int8 linear path passed its load-time proof" in every.stderr
    assert all(f"{p}: int8," in every.stderr for p in passed), every.stderr


def test_a_damaged_int8_matrix_is_an_error_not_a_wrong_product():
    """Corrupt header words (fuzzed) give a named error or the intact product, never a crash."""
    c = quant_codes(random_tensor("Q5_K", 16, 256, seed=9), "Q5_K")
    w = quant_weight([c], "int8")
    x = bf16_rows(2, 256, seed=1)
    want = K.linear(x, w)
    rng = np.random.default_rng(0)
    words = w.data[:8 * 16].view(torch.int64).clone()
    for _ in range(60):
        blob = w.data.clone()
        i = int(rng.integers(1, 16))
        bad = words.clone()
        bad[i] = int(rng.choice([-1, 0, 1, 3, 7, 2 ** 40, int(bad[i]) + 64, int(bad[i]) * 2]))
        blob[:8 * 16] = bad.view(torch.uint8)
        try:
            got = K.ops().linear(x, blob, 16, None, False)
        except RuntimeError as exc:
            assert "quantized weight" in str(exc) or "linear" in str(exc)
            continue
        assert got.shape == want.shape
