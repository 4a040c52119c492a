"""The MoE block in one compiled call (csrc/moe.cpp, issue 46) against models/moe.py's statements of its
order: the experts' step against the loop over experts, bit for bit, for every weight kind the experts come
in (kept quantized under the int8 contract, the grouped path; under "exact"; packed bf16), bf16 and fp32
rows, every int8 path, 1 thread and all cores, a row alone and in any batch; the route against the same
steps written with torch ops here; the compiled stack's MoE layers against the layer-by-layer path; bad
routes are named errors."""
from __future__ import annotations

import pytest
import torch
from kv_helpers import request_pool

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


def grouped(x, chosen, weights, ex) -> torch.Tensor:
    return K.moe_experts(x, chosen, weights, K.expert_set(ex, TOP, True))


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
                got = grouped(x, chosen, weights, ex)
                assert torch.equal(bits(got), bits(loop(x, chosen, weights, ex))), (kind, t, n)
                assert got.abs().max() > 0
    finally:
        torch.set_num_threads(threads)


def test_every_int8_path_groups_to_the_loops_bits_and_a_row_alone_to_its_batch(int8_path):
    ex = experts("int8")
    x, chosen, weights = routed(33, torch.bfloat16, 4)
    together = grouped(x, chosen, weights, ex)
    assert torch.equal(bits(together), bits(loop(x, chosen, weights, ex)))
    for i in (0, 17, 32):
        alone = grouped(x[i:i + 1], chosen[i:i + 1], weights[i:i + 1], ex)
        assert torch.equal(bits(alone[0]), bits(together[i]))


def test_only_int8_experts_take_the_grouped_path():
    assert K.expert_set(experts("int8"), TOP, True).grouped
    assert not any(K.expert_set(experts(kind), TOP, True).grouped for kind in ("exact", "bf16"))


def stated_route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.py's steps 2-4 with torch ops: the kernels' exp and fp64 sum, fp32 probabilities, a stable sort,
    the kept weights' sum added left to right."""
    top = logits.max(dim=-1).values
    probs = (K.exp_shifted(logits, top).double() / K.sum_exp_rows(logits)[:, None]).float()
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, experts)
    if normalize:
        total = weights[:, 0].clone()
        for j in range(1, k):
            total = total + weights[:, j]
        weights = weights / total[:, None]
    return experts, weights


def test_the_compiled_route_is_the_stated_one():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(300, 64, generator=g) * torch.exp(torch.randn(300, 1, generator=g) * 2)
    logits[:20] = torch.randint(-2, 3, (20, 64), generator=g).float()  # many ties
    logits[20, 5] = float("-inf")
    for k, normalize in ((8, True), (8, False), (1, True), (64, True)):
        got, want = moe.route(logits, k, normalize), stated_route(logits, k, normalize)
        assert torch.equal(got[0], want[0]) and torch.equal(bits(got[1]), bits(want[1])), (k, normalize)


def test_the_invariant_kernel_set_takes_the_one_call():
    """moe_mlp runs the compiled block under the invariant kernels, the loop under the library's."""
    assert layers.INVARIANT.experts is K.moe_block and layers.LIBRARY.experts is None


@pytest.mark.parametrize("change, named", [
    (lambda c: c.fill_(EXPERTS), "chose expert 6 of 6"),
    (lambda c: c[:, 1].copy_(c[:, 0]), "twice"),
])
def test_bad_routes_are_named_errors(change, named):
    ex = experts("int8")
    x, chosen, weights = routed(3, torch.bfloat16, 5)
    change(chosen)
    with pytest.raises(RuntimeError, match=named):
        grouped(x, chosen, weights, ex)


@pytest.mark.parametrize("quantize", [None, "q8_0"], ids=["bf16-experts", "int8-experts"])
def test_the_compiled_stack_runs_moe_layers_to_the_layer_by_layer_bits(quantize, tmp_path):
    """A tiny Qwen3-MoE (its first layer dense) through the one-call decoder stack and through the layers one
    by one in Python: the same logits, bit for bit, prefill and a decode step of several rows."""
    from test_moe import _hf_folder

    from margingate.models.decoder import AttentionPlan, DecoderModel
    from margingate.models.loader import load_config, load_state_dict
    from margingate.models.quantize import quantize_state

    _, folder = _hf_folder("qwen3-moe-dense-first", tmp_path)
    config = load_config(folder)
    state = load_state_dict(folder, torch.bfloat16)
    model = DecoderModel(config, quantize_state(state, config, quantize) if quantize else state)
    assert all(L.expert_set.grouped == bool(quantize) for L in model.own_weights.layers if L.experts)
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(8))
    slots = torch.tensor([0] * 12 + [1] * 8)
    positions = torch.cat([torch.arange(12), torch.arange(8)])
    runs = []
    for fused in (True, False):
        model.fused = fused
        kv, tables = request_pool(config, 2, 32, torch.bfloat16)
        assert model._fusable(layers.INVARIANT, torch.bfloat16, kv) == fused
        runs.append(model.forward(tokens, positions, tables, slots, AttentionPlan.all_exact(20), kv))
        runs.append(model.forward(tokens[:2], torch.tensor([12, 8]), tables, torch.tensor([0, 1]),
                                  AttentionPlan.all_exact(2), kv))
    model.fused = True
    assert all(torch.equal(a, b) for a, b in zip(runs[:2], runs[2:]))
