"""The encoder's exact GELU (csrc/rowwise.cpp `gelu_erf8`, kernels/encoder.gelu) is, bit for bit, its definition
written as torch operations (each an IEEE fp32 operation rounded once, exp the contract's): over the whole fp32
range that matters, at signed zeros, infinities, NaN, subnormals and a tensor length that leaves a vector tail,
in fp32 and bf16; and an element's bits do not depend on where it lies in the tensor."""
from __future__ import annotations

import math

import pytest
import torch

from margingate.kernels import encoder, invariant

ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
        -0.82215223, 0.17087277)


def exp(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(1, -1)
    return invariant.exp_shifted(rows, torch.zeros(1)).reshape(x.shape)


def gelu_as_torch_ops(x: torch.Tensor) -> torch.Tensor:
    """The definition, one torch operation per step."""
    h = x.float()
    z = h.abs().mul_(1.0 / math.sqrt(2.0))
    t = z.mul(0.5).add_(1.0).reciprocal_()
    poly = t.mul(ERFC[-1])
    for c in reversed(ERFC[1:-1]):
        poly.add_(c).mul_(t)
    half_erfc = exp(poly.add_(ERFC[0]).sub_(z.mul_(z))).mul_(t).mul_(0.5)
    phi = torch.where(h >= 0, 1.0 - half_erfc, half_erfc)
    return phi.mul_(h).to(x.dtype)


def inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    wide = torch.cat([torch.randn(40_000, generator=g) * s for s in (0.1, 1.0, 3.0, 12.0)])
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 9.0, -9.0,
                          -13.0, -26.0, 87.0, -87.0, 3e38, -3e38])
    return torch.cat([wide, torch.linspace(-30, 30, 20_001), edges])  # 180,016 values: a tail of 0 mod 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_is_its_definition_bit_for_bit(dtype):
    x = inputs()[:-3].to(dtype)  # an odd length: the last values go through the padded tail
    ours, ref = encoder.gelu(x), gelu_as_torch_ops(x)
    assert ours.dtype == dtype
    nan = ours.isnan()  # a NaN's payload is not a value: torch's own bf16 casts write 0xffff or 0x7fc0 by path
    assert torch.equal(nan, ref.isnan()) and nan.sum() == 2
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours[~nan].view(bits), ref[~nan].view(bits))
    exact = torch.special.erf(x.double() / math.sqrt(2.0)).add(1).mul(0.5).mul(x.double())
    close = torch.isfinite(exact) & (exact.abs() > 1e-30)
    assert torch.allclose(ours.double()[close], exact[close], rtol=2e-6 if dtype == torch.float32 else 1e-2)


def test_an_elements_bits_do_not_depend_on_its_place():
    x = inputs()
    whole = encoder.gelu(x)
    for start in (1, 3, 7, 8, 12345):
        assert torch.equal(encoder.gelu(x[start:start + 1001].clone()).view(torch.int32),
                           whole[start:start + 1001].view(torch.int32))
