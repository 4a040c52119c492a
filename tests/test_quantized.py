"""Quantized weights that stay quantized give the bf16 weights' bits (issue 33).

Each supported GGUF type's element must dequantize to exactly the bf16 value the bf16 loader
stores (gguf-py's fp32 dequantization, then one rounding), in Python (QuantCodes.bf16), in the C++
reference and in each ISA's dequantizer; the linear over a quantized matrix must equal the linear
over the same values packed as bf16, on every path this CPU runs; and the embedded model (Q4_1, its
tied head Q8_0) must give the same tokens and logprobs with `weights="exact"` as with `"bf16"`. (The
default, `"auto"`, runs the integer-exact contract instead: tests/test_int8_linear.py.)
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from margingate.kernels import invariant as K
from margingate.kernels.packing import pack
from margingate.kernels.quant_pack import QuantWeight, panelable, quant_weight
from margingate.models.gguf_quant import TYPES, QuantFormatError, quant_codes

# Where each type's fp16 fields lie in its block: random bytes there could be NaN or infinity.
FP16_FIELDS = {"Q8_0": (0, 2), "Q4_0": (0, 2), "Q4_1": (0, 4), "Q5_0": (0, 2), "Q5_1": (0, 4),
               "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210), "Q2_K": (80, 84), "Q3_K": (108, 110),
               "IQ4_NL": (0, 2), "IQ4_XS": (0, 2), "IQ2_XXS": (0, 2), "IQ2_XS": (0, 2), "IQ2_S": (0, 2),
               "IQ3_XXS": (0, 2), "IQ3_S": (0, 2), "IQ1_S": (0, 2), "IQ1_M": (48, 56)}  # IQ1_M: see set_fp16


def set_fp16(blocks: np.ndarray, type_name: str, scales: np.ndarray) -> None:
    """Write the fp16 fields of each block; IQ1_M's one d lies in the top 4 bits of its 4 scale words."""
    a, b = FP16_FIELDS[type_name]
    if type_name != "IQ1_M":
        blocks[:, a:b] = scales.astype(np.float16).view(np.uint8)
        return
    d = scales[:, :1].astype(np.float16).view(np.uint16)
    words = np.ascontiguousarray(blocks[:, a:b]).view(np.uint16) & np.uint16(0x0FFF)
    words |= ((d >> np.array([0, 4, 8, 12], np.uint16)) & np.uint16(15)) << np.uint16(12)
    blocks[:, a:b] = words.view(np.uint8)


def random_tensor(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] of valid blocks: random codes, finite fp16 scales of both signs and wide range."""
    size, nbytes, _ = TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)
    if type_name == "MXFP4":  # an E8M0 exponent per block: 2^(e - 128) over fp16's whole exact range
        blocks[:, 0] = rng.integers(104, 144, blocks.shape[0])
        return blocks.reshape(n, -1)
    a, b = FP16_FIELDS[type_name]
    wide = 2.0 ** rng.integers(-14, 4, (1,))
    scales = (rng.standard_normal((blocks.shape[0], (b - a) // 2)) * wide).astype(np.float16)
    scales[rng.random(scales.shape) < 0.05] = 0  # zero scales: signed zeros come out of them
    tiny = rng.random(scales.shape) < 0.05  # fp16 subnormals: the kernels' conversion must keep them
    scales[tiny] = (rng.integers(1, 1024, tiny.sum()) * rng.choice([-1, 1], tiny.sum())).astype(np.float16) * 2.0 ** -24
    set_fp16(blocks, type_name, scales)
    return blocks.reshape(n, -1)


def loader_bf16(data: np.ndarray, type_name: str) -> torch.Tensor:
    """What the bf16 loader stores (gguf_import.bf16_tensor): gguf-py's dequantization, rounded."""
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(values.copy()).to(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("type_name", sorted(TYPES))
def test_every_type_dequantizes_to_the_loaders_bf16_bit_for_bit(type_name):
    """Python's codes and scales, the C++ reference (whole matrix and rows) under each contract that has a
    layout for the type, and the loader agree. The types the bf16 contract has no layout for (not even as plain
    codes: `QuantCodes.exact_form`) are refused there by name (the loader dequantizes them under `--weights exact`)."""
    data = random_tensor(type_name, 48, 512, seed=len(type_name))
    want = loader_bf16(data, type_name)
    codes = quant_codes(data, type_name)
    assert codes.format == type_name.lower()
    assert same_bits(codes.bf16(), want)
    rows = torch.tensor([0, 17, 47, 17])
    exact = codes.exact_form().exact_layout  # a table of small integers is held as plain codes (MXFP4, IQ3_S)
    for contract in ("exact", "int8") if exact else ("int8",):
        w = quant_weight([codes], contract)
        assert same_bits(w.unpack(), want), contract
        assert same_bits(w.rows(rows), want[rows]), contract
    if not exact:
        with pytest.raises(ValueError, match=f"{type_name.lower()} has no layout under the exact contract"):
            quant_weight([codes], "exact")


@pytest.mark.parametrize("m", [1, 3, 16, 37, 200])
def test_the_linear_over_quantized_panels_equals_the_bf16_linear_on_every_path(m):
    """A fused matrix of five GGUF types (q|k|v of a Q4_K_M file mixes three; 4-bit codes with and
    without a zero point take their own dequantizing step), against the same values packed as bf16,
    at every path this CPU runs, with and without a bias, bf16 and fp32 x."""
    parts = [quant_codes(random_tensor(t, n, 512, seed=i), t) for i, (t, n) in
             enumerate([("Q4_0", 16), ("Q4_1", 16), ("Q4_K", 32), ("Q6_K", 16), ("Q5_0", 20)])]
    w = quant_weight(parts)
    assert w.formats == ("q4_0", "q4_1", "q4_k", "q6_k", "q5_0") and w.shape == (100, 512)
    dense = pack(torch.cat([p.bf16() for p in parts]))
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
    bias = torch.randn(100, generator=g)
    assert not [p for p in K.proofs("bf16") if p["status"] == "failed"]  # a refused path would drop out below
    before = K.path_in_use("bf16")
    try:
        for path in K.usable_paths("bf16"):
            K.use_path(path)
            for b in (None, bias):
                assert same_bits(K.linear(x, w, b), K.linear(x, dense, b)), (path, b is None)
            if path in ("avx512", "avx2"):
                xf = x.float() * 1.001
                assert torch.equal(K.linear(xf, w), K.linear(xf, dense)), path
    finally:
        K.use_path(before)
    assert same_bits(K.linear_reference(x, w), K.linear(x, dense))


def test_rows_that_do_not_fill_panels_are_not_fused_quantized():
    parts = [quant_codes(random_tensor("Q8_0", n, 64), "Q8_0") for n in (20, 16)]
    assert not panelable(parts) and panelable(parts[::-1])
    with pytest.raises(ValueError, match="whole panels"):
        quant_weight(parts)


def test_an_mxfp4_scale_that_fp16_cannot_hold_is_refused_and_a_zero_block_is_kept():
    """MXFP4's codes index its doubled E2M1 values (IQ4_NL's shape) with d = 2^(e - 128) in fp16: exact for e in
    [104, 143]. Outside, kept quantized it would be another number: refused by name. A block of zeros keeps
    its bits whatever its exponent (d 0)."""
    data = random_tensor("MXFP4", 4, 64)
    data[1, 0] = 250
    with pytest.raises(QuantFormatError, match="2\\^122"):
        quant_codes(data, "MXFP4")
    data[1, 0], data[1, 1:17] = 3, 0  # e = 3, all codes +0
    assert same_bits(quant_codes(data, "MXFP4").bf16(), loader_bf16(data, "MXFP4"))


@pytest.mark.parametrize("type_name", ["MXFP4", "IQ3_S"])
def test_a_table_of_small_integers_has_an_exact_form_of_plain_codes(type_name):
    """Under the bf16 contract, which has no table layout, MXFP4 and IQ3_S (values in [-16, 15], no power of two)
    are held as Q5_0's shape (5-bit codes value + 16): the same values, so the same bf16 matrix; a table that
    does not fit (IQ2's +-43 / 8) stays as it is (dequantized under that contract)."""
    data = random_tensor(type_name, 4, 256)
    codes = quant_codes(data, type_name)
    plain = codes.exact_form()
    assert codes.table is not None and not codes.exact_layout
    assert plain.exact_layout and plain.bits == 5 and plain.zero == 16 and plain.table is None
    assert np.array_equal(plain.values(), codes.values()) and same_bits(plain.bf16(), loader_bf16(data, type_name))
    iq2 = quant_codes(random_tensor("IQ2_XXS", 4, 256), "IQ2_XXS")
    assert iq2.exact_form() is iq2


def test_a_scale_that_is_not_finite_is_refused_with_the_tensors_name():
    data = random_tensor("Q4_0", 16, 64)
    data[3, :2] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(QuantFormatError, match="blk.0.attn_q.weight .Q4_0. has scales that are not finite"):
        quant_codes(data, "Q4_0", "blk.0.attn_q.weight")


def test_a_damaged_quantized_matrix_is_an_error_not_a_wrong_product():
    w = quant_weight([quant_codes(random_tensor("Q4_1", 16, 64), "Q4_1")])
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="quantized weight is \\[16, 64\\]"):
        K.ops().linear(x, w.data, 17, None, False)
    short = QuantWeight(w.data[:200].clone(), 16, 64, w.formats)
    with pytest.raises(RuntimeError, match="lies outside the tensor"):
        K.linear(x, short)


@pytest.mark.slow  # two models, 4 prompts x 24 tokens x 2 policies each
def test_the_embedded_model_kept_quantized_gives_the_bf16_models_tokens_and_logprobs(llm, exact_llm, prompts):
    """`weights="exact"` (Q4_1 matrices, the tied Q8_0 head) against `"bf16"`, greedy, under `reference`
    and `fast` (batched), with logprobs; the report names each group's storage and the contract."""
    from margingate.llm import LLM
    from margingate.options import SamplingParams

    bf16, exact = LLM(max_num_seqs=4, weights="bf16"), exact_llm
    for kept in (llm, exact):
        assert kept.environment()["weights"] == {"qkv": "q4_1", "o_proj": "q4_1", "gate_up": "q4_1",
                                                 "down_proj": "q4_1", "lm_head": "q8_0", "embed": "q8_0"}
    assert llm.environment()["quantized_contract"] == "int8" and exact.environment()["quantized_contract"] == "exact"
    assert set(bf16.environment()["weights"].values()) == {"bf16"}
    assert bf16.environment()["quantized_contract"] is None
    from margingate.analysis.roofline import StepCost
    from margingate.models.weights import streamed_bytes

    dense = streamed_bytes(bf16.model.own_weights)  # the roofline's bytes: as stored
    assert dense == StepCost.of(bf16.config).weight_bytes
    for kept in (llm, exact):  # Q4_1: 5 bits, the head Q8_0: 8.5
        assert dense / 3 < streamed_bytes(kept.model.own_weights) < dense / 2.6
    chosen = [prompts[i] for i in (0, 9, 21, 33)]
    params = SamplingParams(logprobs=2)
    for policy in ("reference", "fast"):
        got = exact.generate(chosen, max_new_tokens=24, policy=llm.policy(policy), sampling=params)
        want = bf16.generate(chosen, max_new_tokens=24, policy=bf16.policy(policy), sampling=params)
        assert [c.token_ids for c in got] == [c.token_ids for c in want], policy
        assert [c.logprobs for c in got] == [c.logprobs for c in want], policy


def test_a_gguf_read_directly_is_not_converted_to_bf16_until_a_peer_needs_it(tmp_path):
    """`weights="auto"` on a .gguf path writes only its config and tokenizer (an 8B Q4_K_M would
    otherwise write 16 GB of bf16 beside it)."""
    import shutil

    from margingate.llm import LLM
    from margingate.models.loader import embedded_gguf_path

    source = tmp_path / "copy.gguf"  # a path of its own: a folder of its own in the cache
    shutil.copy(embedded_gguf_path("smollm2-135m"), source)
    llm = LLM(str(source), max_num_seqs=1)
    try:
        assert (llm.folder / "config.json").exists() and (llm.folder / "tokenizer.json").exists()
        assert not list(llm.folder.glob("*.safetensors"))
        assert llm.environment()["weights"]["qkv"] == "q4_1"  # (bench's peers add the tensors: test_cli)
    finally:
        shutil.rmtree(llm.folder)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K", "Q3_K", "IQ4_XS"])
def test_a_matrix_decoded_and_laid_out_a_run_of_rows_at_a_time_is_the_whole_matrix_laid_out_at_once(
        type_name, tmp_path, monkeypatch):
    """A GGUF's matrices are packed CHUNK_ROWS rows at a time (a first load's peak): every field lands in its
    panels' place, and Q / K rows are un-interleaved per head across run boundaries, so the bytes are those
    of the matrix decoded whole. A fused q|k of two head counts, runs of 32 rows (a head: 32 rows)."""
    from margingate.kernels import quant_pack
    from margingate.models.gguf_quant import GGUFMatrix
    from margingate.models.gguf_tensors import RawTensor, ggml_types

    k, types = 256, {t.name: t for t in ggml_types().values()}
    q, kk = random_tensor(type_name, 96, k, seed=1), random_tensor(type_name, 64, k, seed=2)
    path = tmp_path / "rows.bin"
    path.write_bytes(q.tobytes() + kk.tobytes())
    kind = types[type_name].id
    parts = [GGUFMatrix(RawTensor(path, ("q", [k, 96], kind, 0, q.nbytes), ggml_types()), heads=3),
             GGUFMatrix(RawTensor(path, ("k", [k, 64], kind, q.nbytes, kk.nbytes), ggml_types()), heads=2)]
    assert [p.row_unit for p in parts] == [32, 32]
    for contract in ("int8", "exact") if parts[0].run(0, 32).exact_layout else ("int8",):
        whole = quant_weight([p.codes() for p in parts], contract)  # one run each: decoded whole, then laid out
        monkeypatch.setattr(quant_pack, "CHUNK_ROWS", 16)
        runs = quant_weight(parts, contract)  # 3 + 2 runs of 32 rows, each read from the file on its own
        monkeypatch.undo()
        assert torch.equal(runs.data, whole.data) and runs.formats == (type_name.lower(),) * 2
