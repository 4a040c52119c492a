"""Llama-family forward (Llama, Mistral, Qwen2) over rows of (slot, position, token).

The model knows nothing of requests: a forward gets N rows and an attention plan
saying which rows attend exactly (over their own cached prefix) and which attend as
one padded batch (batch-variant on purpose), writes every row's K/V into the cache,
and returns the rows' logits. `KernelChoice.INVARIANT` runs every Linear, norm and activation
through our kernels (`LIBRARY`: PyTorch's); then an exact row's K/V and logits
are a function of its tokens alone. With bf16 activations the whole stack is one
compiled call (`decoder_stack`), bitwise the layer-by-layer path kept here.

This file only wires layers together: every numeric (Linear, RMSNorm, SiLU, RoPE,
attention, the head) lives in `margingate.kernels`, whose VERSION keys measurement
caches. They follow Hugging Face's implementation (RMSNorm in fp32, rotary tables cast
to the activation dtype, bf16 logits) so that `transformers` is the oracle in tests.
The weights come from an explicit name map (`weights.py`).
"""
from __future__ import annotations

import torch

from ..kernels import invariant as invariant_kernels
from ..kernels import layers, rotary
from ..kernels.attention import AttentionPlan, AttentionRows, attend
from ..kernels.choice import KernelChoice
from . import moe, rope_scaling
from .config import ModelConfig
from .kv_cache import KVCache
from .weights import LayerWeights, ModelWeights, build

__all__ = ["AttentionPlan", "LlamaModel", "resolve_kernels"]
KERNELS = ("auto", "compiled", "triton")


def resolve_kernels(kernels: str, device: torch.device) -> str:
    """`auto`: Triton on CUDA, the compiled C++ kernels on CPU. `triton` on CPU runs the CUDA path's
    kernels under Triton's interpreter (TRITON_INTERPRET=1: tests and dry runs, slow); anything that
    cannot run is an error naming what is missing."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r} (choose from {', '.join(KERNELS)})")
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" else "compiled"
    if kernels == "compiled" and device.type != "cpu":
        raise ValueError(f"the compiled invariant kernels run on CPU; on {device} use --kernels triton")
    if kernels == "triton":
        from ..kernels import triton as triton_kernels

        triton_kernels.require()
    return kernels


class LlamaModel:
    unit_offset_norms = False  # Gemma's RMSNorms scale by 1 + weight (gemma3.py)

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                 kernels: str = "auto"):
        """`state`: tensors by Hugging Face name (`loader.load_state_dict`); checked against the
        architecture's name map, so a missing or stray tensor is refused here by name. `kernels`: the
        invariant kernels' backend (`resolve_kernels`): `compiled` (C++, CPU) or `triton`."""
        self.config = config
        self.device = torch.device(device)
        self.kernels = resolve_kernels(kernels, self.device)
        source = getattr(state, "source", "the given state dict")
        # One copy of the weights: packed for our C++ kernels (plain bf16 for Triton's); the library's
        # plain copies in another dtype on first use.
        self.own_weights = build(config, state, self.device, source, packed=not self.triton)
        self._library_weights: dict[torch.dtype, ModelWeights] = {}
        scaled = config.rope_scaling or config.rope_freq_factors
        self._rotary = rotary.RotaryTable(config.head_dim, config.rope_theta, rope_scaling.inv_freq(
            config.head_dim, config.rope_theta, config.rope_scaling, config.rope_freq_factors) if scaled else None)
        # the sliding-window layers' own RoPE base (Gemma 3)
        self._local_rotary = (rotary.RotaryTable(config.head_dim, config.rope_local_theta)
                              if any(config.layer_windows) else None)
        self.fused = True  # one compiled call for the whole stack where it applies (same bits)
        self._stack_weights: list[torch.Tensor] | None = None

    @property
    def triton(self) -> bool:
        """The invariant kernels are the Triton ones (`kernels/triton/`)."""
        return self.kernels == "triton"

    @property
    def invariant_is_fastest(self) -> bool:
        """Do the invariant kernels beat the library's here? Our compiled CPU kernels do, so `fast` runs
        them; on CUDA cuBLAS and SDPA are far ahead of the Triton kernels, so `fast` runs those."""
        return not self.triton

    def weights(self, dtype: torch.dtype) -> ModelWeights:
        """The library kernels' weights, plain, in `dtype`: unpacked on first use (only `fast-library`
        and LayerCast pay for this second copy)."""
        if self.triton and dtype == torch.bfloat16:  # already plain bf16: no second copy
            return self.own_weights
        if dtype not in self._library_weights:
            self._library_weights[dtype] = self.own_weights.to(dtype)
        return self._library_weights[dtype]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                plan: AttentionPlan, kv: KVCache, *, dtype: torch.dtype = torch.bfloat16,
                kernel_choice: KernelChoice = KernelChoice.INVARIANT,
                logits_rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Run N rows through the model; returns fp32 logits of `logits_rows` (default all).

        `kernel_choice`: INVARIANT, every Linear, norm and activation through the invariant kernels of
        the backend (bf16 weights; `dtype` is the activations'); LIBRARY, the library's, with weights in `dtype`.
        """
        ops = layers.kernel_set(kernel_choice, self.triton)
        W = self.own_weights if ops.own_weights else self.weights(dtype)
        h = self._embed(tokens, W, dtype)
        rows = AttentionRows(plan, slots, positions, kernel_choice, triton=self.triton)
        if self._fusable(ops, dtype, kv):
            h = self._stack(h, W, kv, positions, rows)
        else:
            ropes = self._ropes(positions, dtype)
            for li, L in enumerate(W.layers):
                h = self._layer(li, L, h, ops, ropes[li], rows, positions, slots, kv, dtype)
        if logits_rows is not None:
            h = h[logits_rows]
        return ops.logits(h, W.norm, W.lm_head, self.config.rms_eps, self.unit_offset_norms)

    def _embed(self, tokens: torch.Tensor, W: ModelWeights, dtype: torch.dtype) -> torch.Tensor:
        return layers.embed(tokens, W.embed, dtype)

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[tuple, tuple]:
        """cos/sin [N, 1, D] for these positions: the full-attention layers' and the sliding layers'."""
        full = self._rotary.lookup(positions, dtype)
        return full, (self._local_rotary.lookup(positions, dtype) if self._local_rotary else full)

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin for these positions."""
        full, local = self._rope_tables(positions, dtype)
        return [local if self.config.window(i) else full for i in range(self.config.num_layers)]

    def _fusable(self, ops: layers.KernelSet, dtype: torch.dtype, kv: KVCache) -> bool:
        """The compiled stack covers our kernels with bf16 activations and cache: every forward
        but the library's and LayerCast's fp32 ones."""
        return self.fused and ops is layers.INVARIANT and dtype == torch.bfloat16 and kv.k.dtype == torch.bfloat16

    def _stack(self, h: torch.Tensor, W: ModelWeights, kv: KVCache, positions: torch.Tensor,
               rows: AttentionRows) -> torch.Tensor:
        if self._stack_weights is None:  # flattened once, in the kernel's order
            self._stack_weights = invariant_kernels.stack_weights(W.layers)
        cfg = self.config
        (cos, sin), (cos_local, sin_local) = self._rope_tables(positions, torch.bfloat16)
        return invariant_kernels.decoder_stack(
            h, self._stack_weights, cos[:, 0], sin[:, 0], kv.k, kv.v, rows.slots, positions, rows.aligns,
            cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.rms_eps, cfg.attention_scale,
            [cfg.window(i) for i in range(cfg.num_layers)], (cos_local[:, 0], sin_local[:, 0]),
            self.unit_offset_norms, [L.expert_set or invariant_kernels.dense_set() for L in W.layers])

    def _layer(self, li: int, L: LayerWeights, h: torch.Tensor, ops: layers.KernelSet,
               rope: tuple[torch.Tensor, torch.Tensor], rows: AttentionRows, positions: torch.Tensor,
               slots: torch.Tensor, kv: KVCache, dtype: torch.dtype) -> torch.Tensor:
        """One decoder layer: attention then MLP, each a residual branch after its RMSNorm."""
        cfg, n = self.config, h.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        x = ops.rmsnorm(h, L.input_layernorm, cfg.rms_eps)
        q, k, v = ops.linear(x, L.qkv, L.qkv_bias).split((q_size, kv_size, kv_size), dim=-1)
        q, k = q.reshape(n, cfg.num_heads, cfg.head_dim), k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        if L.q_norm is not None:  # Qwen3: q and k RMS-normed per head before RoPE
            q, k = ops.rmsnorm(q, L.q_norm, cfg.rms_eps), ops.rmsnorm(k, L.k_norm, cfg.rms_eps)
        q, k = rotary.rotate(q, *rope), rotary.rotate(k, *rope)
        kv.write(li, slots, positions, k, v.reshape(n, cfg.num_kv_heads, cfg.head_dim))
        attn = attend(q, kv.k[li], kv.v[li], rows, dtype, cfg.attention_scale)
        h = h + ops.linear(attn.reshape(n, -1), L.o_proj, L.o_proj_bias)
        x = ops.rmsnorm(h, L.post_attention_layernorm, cfg.rms_eps)
        if L.experts:
            return h + moe.moe_mlp(x, L, cfg.experts_per_token, cfg.norm_topk, ops)
        return h + ops.mlp(x, L.gate_up, L.down_proj)
