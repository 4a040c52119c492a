"""Gemma 3 forward: the Llama family's rows, cache and kernels, with Gemma's layer.

What differs from Llama, each as transformers' Gemma3ForCausalLM does it (the oracle in
tests/test_gemma3.py):
- every RMSNorm scales by (1 + weight), in fp32, rounded once (`unit_offset`);
- the embedding is multiplied by sqrt(hidden), that factor rounded to the activations' dtype;
- q and k are RMS-normed per head before RoPE;
- the attention output and the MLP output are normed before their residual adds, and the
  MLP's input by its own pre-FFN norm;
- the MLP's activation is GELU with the tanh approximation;
- sliding-window layers see only their last `sliding_window` keys and use a local RoPE base;
  every sixth layer (by default) attends over everything with the global base;
- the attention scale is 1/sqrt(query_pre_attn_scalar).
Every numeric still goes through `margingate.kernels`, so an exact row's bits remain a function
of its own tokens. bf16 forwards on our kernels run the whole stack in one compiled call
(`decoder_stack` with `gemma`), bitwise this layer-by-layer path (tests/test_gemma3.py).
"""
from __future__ import annotations

import math

import torch

from ..kernels import layers, rotary
from ..kernels.attention import AttentionRows, attend
from .config import ModelConfig
from .kv_cache import KVCache
from .llama import LlamaModel
from .weights import LayerWeights, ModelWeights


class Gemma3Model(LlamaModel):
    unit_offset_norms = True

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                 kernels: str = "auto"):
        super().__init__(config, state, device, kernels)
        self._embed_scale = math.sqrt(config.hidden_size)

    def _embed(self, tokens: torch.Tensor, W: ModelWeights, dtype: torch.dtype) -> torch.Tensor:
        h = layers.embed(tokens, W.embed, dtype)
        return h * torch.tensor(self._embed_scale, dtype=dtype)  # one rounded product per element

    def _layer(self, li: int, L: LayerWeights, h: torch.Tensor, ops: layers.KernelSet,
               rope: tuple[torch.Tensor, torch.Tensor], rows: AttentionRows, positions: torch.Tensor,
               slots: torch.Tensor, kv: KVCache, dtype: torch.dtype) -> torch.Tensor:
        cfg, n = self.config, h.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return ops.rmsnorm(x, weight, cfg.rms_eps, True)

        x = norm(h, L.input_layernorm)
        q, k, v = ops.linear(x, L.qkv).split((q_size, kv_size, kv_size), dim=-1)
        q = rotary.rotate(norm(q.reshape(n, cfg.num_heads, cfg.head_dim), L.q_norm), *rope)
        k = rotary.rotate(norm(k.reshape(n, cfg.num_kv_heads, cfg.head_dim), L.k_norm), *rope)
        kv.write(li, slots, positions, k, v.reshape(n, cfg.num_kv_heads, cfg.head_dim))
        attn = attend(q, kv.k[li], kv.v[li], rows, dtype, cfg.attention_scale, cfg.window(li))
        h = h + norm(ops.linear(attn.reshape(n, -1), L.o_proj), L.post_attention_layernorm)
        x = norm(h, L.pre_feedforward_layernorm)
        return h + norm(ops.mlp(x, L.gate_up, L.down_proj, gelu=True), L.post_feedforward_layernorm)
