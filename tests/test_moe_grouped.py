"""The MoE block's experts in one compiled call (csrc/moe.cpp, issue 46) against models/moe.py's loop over
experts, which states the order: the same bits for every weight kind the experts come in (kept quantized
under the int8 contract, the grouped path; under "exact"; packed bf16), bf16 and fp32 rows, every int8 path,
1 thread and all cores, a row alone and in any batch; bad routes are named errors."""
from __future__ import annotations

import pytest
import torch

from margingate.kernels import invariant as K
from margingate.kernels import layers
from margingate.kernels.packing import pack
from margingate.kernels.quant_pack import quant_weight
from margingate.models import moe
from margingate.models.gguf_quant import quant_codes
from margingate.models.quantize import quantize_rows

HIDDEN, INTER, EXPERTS, TOP = 256, 256, 6, 3  # three per row: their order of addition shows


def _quantized(w: torch.Tensor, type_name: str):
    return quant_codes(quantize_rows(w, type_name, "expert"), type_name)


def experts(kind: str) -> list:
    """EXPERTS (gate_up, down) pairs of random weights: gate|up in Q4_K and down in Q6_K's place (Q8_0 here,
    our quantizer's other type) as a Q4_K_M file has them, kept quantized under `kind`, or packed bf16."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(EXPERTS):
        gate, up = ((torch.randn(INTER, HIDDEN, generator=g) * 0.05).to(torch.bfloat16) for _ in range(2))
        down = (torch.randn(HIDDEN, INTER, generator=g) * 0.05).to(torch.bfloat16)
        if kind == "bf16":
            out.append((pack(torch.cat([gate, up])), pack(down)))
        else:
            out.append((quant_weight([_quantized(gate, "Q4_K"), _quantized(up, "Q4_K")], kind),
                        quant_weight([_quantized(down, "Q8_0")], kind)))
    return out


def routed(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, HIDDEN, generator=g) * 2).to(dtype)
    logits = torch.randn(n, EXPERTS, generator=g)
    logits[:, EXPERTS - 1] = -30.0  # one expert no row chooses
    chosen, weights = moe.route(logits, TOP, normalize=True)
    return x, chosen, weights.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def loop(x, chosen, weights, ex) -> torch.Tensor:
    return moe.expert_loop(x, chosen, weights, ex, layers.INVARIANT)


@pytest.mark.parametrize("kind", ["int8", "exact", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-rows", "fp32-rows"])
def test_the_one_call_gives_the_loops_bits(kind, dtype):
    ex = experts(kind)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for n, seed in ((1, 1), (5, 2), (40, 3)):
                x, chosen, weights = routed(n, dtype, seed)
                got = K.moe_experts(x, chosen, weights, ex)
                assert torch.equal(bits(got), bits(loop(x, chosen, weights, ex))), (kind, t, n)
                assert got.abs().max() > 0
    finally:
        torch.set_num_threads(threads)


def test_every_int8_path_groups_to_the_loops_bits_and_a_row_alone_to_its_batch(int8_path):
    ex = experts("int8")
    x, chosen, weights = routed(33, torch.bfloat16, 4)
    together = K.moe_experts(x, chosen, weights, ex)
    assert torch.equal(bits(together), bits(loop(x, chosen, weights, ex)))
    for i in (0, 17, 32):
        alone = K.moe_experts(x[i:i + 1], chosen[i:i + 1], weights[i:i + 1], ex)
        assert torch.equal(bits(alone[0]), bits(together[i]))


def test_the_invariant_kernel_set_takes_the_one_call():
    """moe_mlp runs the compiled call under the invariant kernels, the loop under the library's."""
    assert layers.INVARIANT.experts is K.moe_experts and layers.LIBRARY.experts is None


@pytest.mark.parametrize("change, named", [
    (lambda c: c.fill_(EXPERTS), "chose expert 6 of 6"),
    (lambda c: c[:, 1].copy_(c[:, 0]), "twice"),
])
def test_bad_routes_are_named_errors(change, named):
    ex = experts("int8")
    x, chosen, weights = routed(3, torch.bfloat16, 5)
    change(chosen)
    with pytest.raises(RuntimeError, match=named):
        K.moe_experts(x, chosen, weights, ex)
