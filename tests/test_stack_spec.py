"""The compiled decoder stack's spec (`kernels/stack.py`, csrc/stack.cpp): its weights found by name and its
switches held to the tensors it is given; a disagreement is a named error, never a silently different forward."""
from __future__ import annotations

import pytest
import torch

from margingate.kernels import invariant as K
from margingate.kernels import stack


def test_decoder_stack_finds_its_weights_by_name():
    """The stack's weight order is stated once (STACK_WEIGHTS) and passed to C++, which finds each
    weight by name: an order missing a name, or naming one twice, is refused by that name."""
    names = list(stack.STACK_WEIGHTS)
    for order, message in ((names[1:], "no layer weight named input_layernorm"), (names + ["qkv"], "qkv named twice")):
        spec = K.ops().StackSpec()
        spec.names = order
        with pytest.raises(RuntimeError, match=message):
            spec.check()


def test_a_stack_spec_that_disagrees_with_its_weights_is_refused():
    """The layer's switches and its tensors must agree: q/k norms the spec would skip, or a spec asking for
    norms the layer lacks, are named errors, not a silently different forward."""
    e, w = torch.empty(0, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    spec = K.ops().StackSpec()
    spec.names, spec.windows, spec.experts = list(stack.STACK_WEIGHTS), [0], [stack.dense_set()]
    spec.heads, spec.kv_heads, spec.intermediate = 2, 1, 16
    with_qk = {"q_norm": w, "k_norm": w}
    spec.weights = [with_qk.get(name, e) for name in stack.STACK_WEIGHTS]
    with pytest.raises(RuntimeError, match="has q/k norms its spec does not use"):
        spec.check()
    spec.qk_norm = True
    spec.check()
    spec.sandwich_norms = True
    with pytest.raises(RuntimeError, match="lacks its feed-forward norms"):
        spec.check()
