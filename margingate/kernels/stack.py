"""The decoder stack in one compiled call (`csrc/stack.cpp`): every layer of a forward with bf16 activations
(over a bf16 or int8 paged cache), bitwise `models/decoder.py`'s layer-by-layer path.

What stays fixed for a model (its `LayerSpec`, shape, weights and experts) is handed to C++ once, as a
`StackSpec`; each call passes only the rows: hidden states, RoPE tables, the cache, block tables, positions, aligns.
"""
from __future__ import annotations

import functools

import torch

from .invariant import expert_set, ops
from .layer_spec import LayerSpec
from .packing import PackedWeight
from .quant_pack import QuantWeight

# A decoder layer's tensors as the stack takes them, by LayerWeights field: the one statement of their
# order. C++ receives these names with the tensors and finds each weight by name.
STACK_WEIGHTS = ("input_layernorm", "qkv", "qkv_bias", "o_proj", "o_proj_bias", "post_attention_layernorm",
                 "gate_up", "down_proj", "q_norm", "k_norm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "router", "sinks")


def stack_weights(layers: list) -> list[torch.Tensor]:
    """The layers' weights flattened: STACK_WEIGHTS per layer, packed (or quantized) matrices as their data,
    an absent weight (a bias, Gemma's norms on a Llama) as an empty tensor."""
    none = torch.empty(0, dtype=torch.bfloat16)
    flat = (getattr(L, name) for L in layers for name in STACK_WEIGHTS)
    return [none if t is None else t.data if isinstance(t, (PackedWeight, QuantWeight)) else t for t in flat]


@functools.cache
def dense_set():
    """The empty `expert_set` of a dense layer."""
    return expert_set([], 0, False)


def stack_spec(layer: LayerSpec, layers: list, *, heads: int, kv_heads: int, intermediate: int, eps: float,
               scale: float, windows: list[int]):
    """The compiled stack's description of a model: its layer's switches, its shape, each layer's sliding
    window (0: none), its weights (`layers`: LayerWeights) and each layer's experts (a dense layer's empty)."""
    spec = ops().StackSpec()
    spec.unit_offset_norms, spec.qk_norm = layer.unit_offset_norms, layer.qk_norm
    spec.sandwich_norms, spec.gelu_tanh = layer.sandwich_norms, layer.activation == "gelu_tanh"
    spec.fp32_norm_product = layer.fp32_norm_product
    spec.heads, spec.kv_heads, spec.intermediate, spec.eps, spec.scale = heads, kv_heads, intermediate, eps, scale
    spec.windows = list(windows)
    spec.weights, spec.names = stack_weights(layers), list(STACK_WEIGHTS)
    spec.experts = [L.expert_set or dense_set() for L in layers]
    spec.check()
    return spec


def decoder_stack(h: torch.Tensor, spec, rope: tuple[torch.Tensor, torch.Tensor],
                  local_rope: tuple[torch.Tensor, torch.Tensor], cache: list[torch.Tensor], kv_rotate: bool,
                  tables: torch.Tensor, table_of: torch.Tensor, positions: torch.Tensor,
                  aligns: torch.Tensor) -> torch.Tensor:
    """Every decoder layer of `spec` (`stack_spec`) for bf16 rows h [N, hidden], updated in place and
    returned; K/V written into `cache` ([k, v, k_scale, v_scale]: KVPool.tensors; stored rotated where
    `kv_rotate`: KVPool.rotate) through the rows' block
    tables (tables[table_of[r]]). `rope`: the rows' cos, sin ([N, 1, D] or [N, D]); `local_rope`: the sliding
    layers' (the same tables where the model has one base); attention chunks aligned per row as in
    `invariant.attention`."""
    cos, sin = (t.reshape(t.shape[0], -1).contiguous() for t in rope)
    cos_local, sin_local = (t.reshape(t.shape[0], -1).contiguous() for t in local_rope)
    ops().decoder_stack(h, spec, cos, sin, cos_local, sin_local, cache, kv_rotate, tables, table_of, positions,
                        aligns)
    return h
