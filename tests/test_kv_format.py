"""The quantized KV cache formats (int8, int4; kernels/kv_format.py, csrc/contract.h 6) held to their stated order:
the compiled store equals the torch reference bit for bit (codes and scales, rotated or not, the special groups
included); attention over a quantized cache equals attention over an fp32 cache holding its values with the
query rotated and the output rotated back, bit for bit, at any row count and thread count; and the formats are
what they claim to be (bytes, closeness to the values stored, columns that round-trip through a shared block)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from margingate.kernels import invariant as K
from margingate.kernels.kv_format import KV_FORMATS, dequantize, hadamard, quantize
from margingate.models.kv_cache import BlockTable, KVPool

D, HKV, BLOCK = 64, 2, 16
# every quantized layout the kernels read: the formats offered, and each without its rotation (the kernels' plain
# path, and the per-head groups int8 had before groups of 32)
PLAIN = {"int8-plain": dataclasses.replace(KV_FORMATS["int8"], rotate=False),
         "int4-plain": dataclasses.replace(KV_FORMATS["int4"], rotate=False),
         "int8-head": dataclasses.replace(KV_FORMATS["int8"], rotate=False, group=D)}
FORMATS = ["int8", "int4", *PLAIN]


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}-threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def plain_formats(monkeypatch):
    for name, fmt in PLAIN.items():
        monkeypatch.setitem(KV_FORMATS, name, fmt)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, so that NaN scales compare equal to themselves."""
    return t.contiguous().view(torch.uint8)


def special_rows(n: int, seed: int, finite: bool = False) -> torch.Tensor:
    """[n, HKV, D] bf16 rows: random ones, and the groups the order names: all zero, a value of largest magnitude
    twice with opposite signs (int4's first among equals), denormal-sized values, and (unless `finite`) a NaN and
    an infinity."""
    x = torch.randn(n, HKV, D, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, 1] = 0
    x[3, 0, :32] = 0.5
    x[3, 0, 7], x[3, 0, 20] = -4.0, 4.0
    x[4, 1] *= 1e-38
    if not finite:
        x[1, 0, 5] = float("nan")
        x[2, 1, 40] = float("inf")
    return x.to(torch.bfloat16)


def written(name: str, n: int = 24, seed: int = 0, finite: bool = False):
    """A one-layer pool of format `name` with rows [n, HKV, D] written at positions 0..n-1 of table 0, its blocks
    in a scrambled order; (pool, tables, K rows, V rows)."""
    pool = KVPool(1, 6, BLOCK, HKV, D, dtype=name)
    tables = torch.tensor([[4, 1, 3, 0, 2, 5]])
    k, v = special_rows(n, seed, finite), special_rows(n, seed + 1, finite)
    pool.write(0, tables, torch.zeros(n, dtype=torch.long), torch.arange(n), k, v)
    return pool, tables, k, v


@pytest.mark.parametrize("name", FORMATS)
def test_the_store_follows_its_documented_order(name):
    """Each (position, head) as the reference states it: rotated (or not), then per group a scale and codes;
    zero groups store scale 0, a NaN or an infinity scale NaN, codes 0."""
    pool, tables, k, v = written(name)
    pos = torch.arange(k.shape[0])
    blocks, rows = tables[0, pos // BLOCK], pos % BLOCK
    for rows_in, codes, scales in ((k, pool.k, pool.k_scale), (v, pool.v, pool.v_scale)):
        want_codes, want_scales = quantize(rows_in, KV_FORMATS[name])
        assert torch.equal(codes[0, blocks, :, rows], want_codes)
        assert torch.equal(bits(scales[0, blocks, :, rows]), bits(want_scales))
    s = pool.k_scale[0, blocks, :, rows]
    assert (s[0, 1] == 0).all() and s[1, 0].isnan().any() and s[2, 1].isnan().any()


@pytest.mark.parametrize("name", FORMATS)
def test_a_quantized_cache_reads_back_close_to_what_was_stored(name):
    """Dequantized (and rotated back), each finite head is within the format's bound of what was stored: a code
    is off by at most c x its group's largest magnitude (c = 1 / 254 for int8; 1 / 8 for int4, whose code 8 is
    clamped to 7); rotated, that holds for the rotated values, whose largest is at most sqrt(R) |x|_2, and the
    rotation back divides the error's norm by sqrt(R). The reference's rotation is its own inverse up to 1 / R."""
    pool, tables, k, _ = written(name)
    pos = torch.arange(k.shape[0])
    blocks, rows = tables[0, pos // BLOCK], pos % BLOCK
    fmt = KV_FORMATS[name]
    back = dequantize(pool.k[0, blocks, :, rows], pool.k_scale[0, blocks, :, rows], unrotate=fmt.rotate)
    x = k.float()
    fine = torch.isfinite(x).all(-1)
    c = 1 / 254 if fmt.bits == 8 else 1 / 8
    if fmt.rotate:
        assert ((back - x).norm(dim=-1)[fine] <= D ** 0.5 * x.norm(dim=-1)[fine] * c * 1.001).all()
    else:
        assert ((back - x).abs().amax(-1)[fine] <= x.abs().amax(-1)[fine] * c * 1.001).all()
    assert (back - x)[fine].abs().max() > 0  # it did quantize
    y = torch.randn(5, D)
    assert torch.allclose(hadamard(hadamard(y)) / D, y, atol=1e-6)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attention_over_a_quantized_cache_is_attention_over_its_values_rotated(name, qdtype, threads):
    """contract.h 6c: q rotated (times 1 / R), attention over the cache's values as fp32 (an fp32 cache holding
    code x scale), the output rotated back (times 1 / R), then rounded: the same bits as the kernel, for rows
    over 1..24 keys at once and alone."""
    pool, tables, _, _ = written(name, seed=3, finite=True)
    finite = KVPool(1, 6, BLOCK, HKV, D, dtype="float32")
    finite.k[0], finite.v[0] = dequantize(pool.k[0], pool.k_scale[0]), dequantize(pool.v[0], pool.v_scale[0])
    lengths = torch.tensor([1, 7, 16, 17, 24, 24])
    table_of = torch.zeros(6, dtype=torch.long)
    q = (torch.randn(6, 4, D, generator=torch.Generator().manual_seed(4)) * 2).to(qdtype)
    rotate = KV_FORMATS[name].rotate
    got = K.attention(q, pool.layer(0), tables, table_of, lengths, 0.125)
    qr = hadamard(q.float()) * (1 / D) if rotate else q.float()
    out = K.attention(qr, finite.layer(0), tables, table_of, lengths, 0.125)
    want = (hadamard(out) * (1 / D) if rotate else out).to(qdtype)
    assert torch.equal(got, want)
    alone = torch.cat([K.attention(q[i:i + 1], pool.layer(0), tables, table_of[:1], lengths[i:i + 1], 0.125)
                       for i in range(6)])
    assert torch.equal(got, alone)


def test_bytes_per_block_count_codes_and_scales():
    """A block's K and V bytes, every layer: bf16 values, int8 codes or int4 codes two to a byte, each with an
    fp32 scale per 32 values; what the pool's sizing (bytes_per_head) assumes."""
    per = {"bfloat16": 2 * 64, "int8": 64 + 2 * 4, "int4": 32 + 2 * 4}
    for name, head in per.items():
        assert KVPool(3, 2, 4, 2, 64, dtype=name).bytes_per_block == 2 * 3 * 2 * 4 * head
        assert KV_FORMATS[name].bytes_per_head(64) == head
    with pytest.raises(ValueError, match="multiple of 16"):
        KVPool(1, 2, 4, 2, 40, dtype="int4")


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_columns_round_trip_through_a_shared_block(name):
    """A quantized cache's column (codes and scales) read from one table and written into a block that a fork
    shares: the write copies the block first, lands the codes and scales bitwise, and leaves the sibling's
    bytes alone (margin's column repair, on a fork's shared prompt block)."""
    pool = KVPool(2, 6, 4, 2, 64, dtype=name)
    a = BlockTable.empty(pool)
    a.prepare(0, 8)
    for li in range(2):
        pool.write(li, torch.tensor([a.blocks]), torch.zeros(8, dtype=torch.long), torch.arange(8),
                   torch.randn(8, 2, 64).to(torch.bfloat16), torch.randn(8, 2, 64).to(torch.bfloat16))
    fork = BlockTable.empty(pool)
    fork.share(a, 8)
    before = [t.clone() for t in pool.tensors()]
    column = a.read(1)
    fork.overwrite(6, column)  # position 6: the shared second block, copied on write
    assert fork.blocks[1] != a.blocks[1] and pool.refs[a.blocks[1]] == 1
    assert all(torch.equal(x, y) for x, y in zip(fork.read(6), column))
    for t, old in zip(pool.tensors(), before):  # the sibling's blocks kept their bytes
        assert torch.equal(t[:, a.blocks], old[:, a.blocks])
