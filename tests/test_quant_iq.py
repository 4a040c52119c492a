"""The IQ1, IQ2 and IQ3 grids re-coded at load into 3- or 4-bit codes of a signed table (issue 64; models/gguf_iq.py).

Blocks written by llama.cpp's own quantizer (tests/data/iq_blocks.npz, scripts/quantize_iq_gguf.py --blocks:
ggml_quantize_chunk with a uniform importance matrix) must re-code to gguf-py's fp32 dequantized values bit
for bit (table value x (2 s + 1) x d x 2^-e: every product exact), and give the numpy statement of the
integer-exact contract on every int8 path. Random blocks of every type run through the same checks in
tests/test_quantized.py and tests/test_int8_linear.py (they iterate gguf_quant.TYPES); a whole model of these
types is tests/test_quant_types.py's (slow tier).
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from margingate.kernels import invariant as K
from margingate.kernels.quant_pack import TABLES, quant_weight
from margingate.models.gguf_iq import IQ_TYPES
from margingate.models.gguf_quant import quant_codes

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_int8_linear import bf16_rows, numpy_linear  # noqa: E402
from test_quantized import same_bits  # noqa: E402

BLOCKS = np.load(Path(__file__).parent / "data" / "iq_blocks.npz")
# bits a weight in memory (codes, an int8 s per group, an fp16 d per 256) and in the file
BITS = {"IQ2_XXS": (3.3125, 2.0625), "IQ2_XS": (3.5625, 2.3125), "IQ2_S": (3.5625, 2.5625),
        "IQ3_XXS": (4.3125, 3.0625), "IQ3_S": (4.3125, 3.4375), "IQ1_S": (3.3125, 1.5625), "IQ1_M": (3.5625, 1.75)}


@pytest.mark.parametrize("type_name", sorted(IQ_TYPES))
def test_llama_cpps_blocks_re_code_to_gguf_pys_fp32_values_bit_for_bit(type_name):
    data = BLOCKS[type_name]
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    c = quant_codes(data, type_name)
    assert np.array_equal(c.fp32().view(np.int32), want.view(np.int32))
    assert c.table == IQ_TYPES[type_name][3] and c.zero == 0 and c.block == 256
    values = TABLES[c.table][1]
    assert c.codes.max() < len(values) == 1 << c.bits and np.abs(values).max() <= 62
    assert c.s.min() >= 1 and c.s.max() <= 31 and (c.s % 2 == 1).all()  # 2 s + 1
    n, k = c.codes.shape
    stored = c.bits * n * k + 8 * c.s.size + 16 * c.d.size
    assert (stored / (n * k), 8 * data.nbytes / (n * k)) == BITS[type_name]


def test_every_int8_path_gives_the_contract_on_llama_cpps_blocks(int8_path):
    """Every IQ type's llama.cpp blocks, one fused matrix per table width, against numpy: the scalar reference
    and the path (the 3-bit codes and the 4-bit ones, groups of 16 and 32, d / 8, d / 4 and d)."""
    x = bf16_rows(19, 512, seed=64)
    for names in (("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"), ("IQ3_XXS", "IQ3_S")):
        parts = [quant_codes(BLOCKS[t], t) for t in names]
        want = np.concatenate([numpy_linear(x.float().numpy(), c) for c in parts], axis=1)
        want = torch.from_numpy(want).to(torch.bfloat16)
        w = quant_weight(parts, "int8")
        assert same_bits(K.linear_reference(x, w), want), names
        assert same_bits(K.linear(x, w), want), (int8_path, names)
