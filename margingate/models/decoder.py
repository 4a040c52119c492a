"""The decoder forward, for every architecture, over rows of (slot, position, token).

One layer, read from the architecture's `LayerSpec` (`kernels/layer_spec.py`, per architecture in
`architectures.py`): norm, q/k/v, (q/k norms), RoPE, attention, output, residual, norm, MLP or mixture of
experts, residual, with the switches the spec names (Gemma's (1 + w) norms and sandwich norms, GELU-tanh,
the scaled embedding). The compiled stack (`csrc/stack.cpp`) reads the same spec, and is bitwise this path.

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

import math
from collections.abc import Callable

import torch

from ..kernels import layers, rotary
from ..kernels import stack as compiled_stack
from ..kernels.attention import AttentionPlan, AttentionRows, attend
from ..kernels.choice import KernelChoice
from . import moe, rope_scaling
from .config import ModelConfig
from .kv_cache import KVPool
from .weights import LayerWeights, ModelWeights, build

__all__ = ["AttentionPlan", "DecoderModel", "resolve_kernels"]
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


class DecoderModel:
    """A decoder-only transformer of any architecture in `architectures.ARCHITECTURES` (`config.layer`)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                 kernels: str = "auto"):
        """`state`: tensors by Hugging Face name (`loader.load_state_dict`); checked against the
        architecture's name map, so a missing or stray tensor is refused here by name. `kernels`: the
        invariant kernels' backend (`resolve_kernels`): `compiled` (C++, CPU) or `triton`."""
        self.config = config
        self.spec = config.layer
        self.device = torch.device(device)
        self.kernels = resolve_kernels(kernels, self.device)
        source = getattr(state, "source", "the given state dict")
        # One copy of the weights: packed for our C++ kernels (plain bf16 for Triton's); the library's
        # plain copies in another dtype on first use.
        self.own_weights = build(config, state, self.device, source, packed=not self.triton)
        self._library_weights: dict[torch.dtype, ModelWeights] = {}
        self._rotary, self._local_rotary = rotary_tables(config)
        self.fused = True  # one compiled call for the whole stack where it applies (same bits)
        self._stack_spec = None  # kernels/stack.py's StackSpec, built on the first compiled forward

    @property
    def triton(self) -> bool:
        """The invariant kernels are the Triton ones (`kernels/triton/`)."""
        return self.kernels == "triton"

    @property
    def invariant_is_fastest(self) -> bool:
        """Do the invariant kernels beat the library's here? Our compiled CPU kernels do, so `fast` runs
        them; on CUDA cuBLAS and SDPA are far ahead of the Triton kernels, so `fast` runs those."""
        return not self.triton

    def reserve_positions(self, n: int) -> None:
        """Build the RoPE tables of positions [0, n) now, so that no forward reads its positions on the host
        (recorded forwards: engine/step_graphs.py)."""
        for table in filter(None, (self._rotary, self._local_rotary)):
            table.reserve(n)

    def replace_weights(self, weights: ModelWeights) -> None:
        """Run `weights` from the next forward on (`weights.build` made them from the same config): the
        library's copies and the compiled stack's view of the old ones are dropped."""
        self.own_weights = weights
        self._library_weights.clear()
        self._stack_spec = None

    def weights(self, dtype: torch.dtype) -> ModelWeights:
        """The library kernels' weights, plain, in `dtype`: unpacked on first use (only `fast-library`
        and LayerCast pay for this second copy)."""
        if self.triton and dtype == torch.bfloat16:  # already plain bf16: no second copy
            return self.own_weights
        if dtype not in self._library_weights:
            self._library_weights[dtype] = self.own_weights.to(dtype)
        return self._library_weights[dtype]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, table_of: torch.Tensor,
                plan: AttentionPlan, kv: KVPool, *, dtype: torch.dtype = torch.bfloat16,
                kernel_choice: KernelChoice = KernelChoice.INVARIANT,
                logits_rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Run N rows through the model; returns fp32 logits of `logits_rows` (default all). Row r's K/V go
        to (and its keys come from) its request's block table tables[table_of[r]] in the pool `kv`.

        `kernel_choice`: INVARIANT, every Linear, norm and activation through the invariant kernels of
        the backend (bf16 weights; `dtype` is the activations'); LIBRARY, the library's, with weights in `dtype`.
        """
        ops = layers.kernel_set(kernel_choice, self.triton)
        W = self.own_weights if ops.own_weights else self.weights(dtype)
        h = self._layers(tokens, positions, AttentionRows(plan, tables, table_of, positions, kernel_choice,
                                                          triton=self.triton), kv, ops, W, dtype)
        if logits_rows is not None:
            h = h[logits_rows]
        return ops.logits(h, W.norm, W.lm_head, self.config.rms_eps, self.spec.norm_mode)

    @torch.inference_mode()
    def final_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                     table_of: torch.Tensor, plan: AttentionPlan, kv: KVPool, *,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """`forward`'s rows through the invariant kernels up to the final norm: what the head reads, in
        `dtype` (a decoder's embedding pools these)."""
        ops, W = layers.kernel_set(KernelChoice.INVARIANT, self.triton), self.own_weights
        h = self._layers(tokens, positions, AttentionRows(plan, tables, table_of, positions, triton=self.triton),
                         kv, ops, W, dtype)
        return ops.rmsnorm(h, W.norm, self.config.rms_eps, self.spec.unit_offset_norms)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, rows: AttentionRows, kv: KVPool,
                ops: layers.KernelSet, W: ModelWeights, dtype: torch.dtype) -> torch.Tensor:
        """The embedding and every layer: the last layer's hidden states, before the final norm."""
        h = self._embed(tokens, W, dtype)
        if self._fusable(ops, dtype, kv):
            return self._stack(h, W, kv, positions, rows)
        ropes = self._ropes(positions, dtype)
        for li, L in enumerate(W.layers):
            h = self._layer(li, L, h, ops, ropes[li], rows, kv, dtype)
        return h

    def _embed(self, tokens: torch.Tensor, W: ModelWeights, dtype: torch.dtype) -> torch.Tensor:
        return scale_embedding(self.config, layers.embed(tokens, W.embed, dtype))

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[tuple, tuple]:
        """cos/sin [N, 1, D] for these positions: the full-attention layers' and the sliding layers'."""
        return rope_lookup(self._rotary, self._local_rotary, positions, dtype)

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin for these positions."""
        full, local = self._rope_tables(positions, dtype)
        return [local if self.config.window(i) else full for i in range(self.config.num_layers)]

    def _fusable(self, ops: layers.KernelSet, dtype: torch.dtype, kv: KVPool) -> bool:
        """The compiled stack covers our kernels with bf16 activations: every forward but the library's
        and LayerCast's fp32 ones."""
        return self.fused and ops is layers.INVARIANT and dtype == torch.bfloat16

    def _stack(self, h: torch.Tensor, W: ModelWeights, kv: KVPool, positions: torch.Tensor,
               rows: AttentionRows) -> torch.Tensor:
        if self._stack_spec is None:  # the layer, shape and weights handed to the compiled stack once
            cfg = self.config
            self._stack_spec = compiled_stack.stack_spec(
                self.spec, W.layers, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                intermediate=cfg.intermediate_size, eps=cfg.rms_eps, scale=cfg.attention_scale,
                windows=[cfg.window(i) for i in range(cfg.num_layers)])
        full, local = self._rope_tables(positions, torch.bfloat16)
        return compiled_stack.decoder_stack(h, self._stack_spec, full, local, kv.tensors(), kv.rotate, rows.tables,
                                            rows.table_of, positions, rows.aligns)

    def _layer(self, li: int, L: LayerWeights, h: torch.Tensor, ops: layers.KernelSet,
               rope: tuple[torch.Tensor, torch.Tensor], rows: AttentionRows, kv: KVPool,
               dtype: torch.dtype) -> torch.Tensor:
        """One decoder layer whose rows write their K/V into the pool and attend over their cached keys."""
        cfg = self.config

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.write(li, rows.tables, rows.table_of, rows.positions, k, v)
            return attend(q, kv.layer(li), rows, dtype, cfg.attention_scale, cfg.window(li), L.sinks)
        return decoder_layer(cfg, L, h, ops, rope, attention)


def rotary_tables(config: ModelConfig) -> tuple[rotary.RotaryTable, rotary.RotaryTable | None]:
    """The model's RoPE tables: the full-attention layers' (with the config's scaling) and, where the sliding
    layers have their own base (Gemma 3), theirs, else None (gpt-oss's sliding layers rotate as the others)."""
    scaled = config.rope_scaling or config.rope_freq_factors
    full = rotary.RotaryTable(config.head_dim, config.rope_theta, rope_scaling.inv_freq(
        config.head_dim, config.rope_theta, config.rope_scaling, config.rope_freq_factors) if scaled else None,
        scale=rope_scaling.attention_factor(config.rope_scaling))
    local = rotary.RotaryTable(config.head_dim, config.rope_local_theta) if config.rope_local_theta else None
    return full, local


def rope_lookup(full: rotary.RotaryTable, local: rotary.RotaryTable | None, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[tuple, tuple]:
    """cos/sin [N, 1, D] for these positions: the full-attention layers' and the sliding layers'."""
    cos_sin = full.lookup(positions, dtype)
    return cos_sin, (local.lookup(positions, dtype) if local else cos_sin)


def scale_embedding(config: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    """Embedding rows as the first layer reads them: times sqrt(hidden) where the layer says so (one rounded
    product per element, the factor rounded to the activations' dtype first)."""
    if config.layer.embed_scale:
        return h * torch.tensor(math.sqrt(config.hidden_size), dtype=h.dtype)
    return h


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) -> the rows' outputs


def decoder_layer(cfg: ModelConfig, L: LayerWeights, h: torch.Tensor, ops: layers.KernelSet,
                  rope: tuple[torch.Tensor, torch.Tensor], attention: Attention) -> torch.Tensor:
    """One decoder layer, the one statement of it that every Python forward runs (the engine's, and the
    trainable model's with autograd kernels): attention then MLP, each a residual branch after its RMSNorm
    (and, with sandwich norms, normed again before its add). `attention` takes the rows' rotated q
    [N, heads, D] and k, v [N, kv_heads, D], and returns their attention outputs."""
    spec, n = cfg.layer, h.shape[0]
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, weight, cfg.rms_eps, spec.norm_mode)

    q, k, v = ops.linear(norm(h, L.input_layernorm), L.qkv, L.qkv_bias).split((q_size, kv_size, kv_size), dim=-1)
    q, k = q.reshape(n, cfg.num_heads, cfg.head_dim), k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    if spec.qk_norm:  # per head, before RoPE
        q, k = norm(q, L.q_norm), norm(k, L.k_norm)
    q, k = rotary.rotate(q, *rope), rotary.rotate(k, *rope)
    attn = attention(q, k, v.reshape(n, cfg.num_kv_heads, cfg.head_dim))
    y = ops.linear(attn.reshape(n, -1), L.o_proj, L.o_proj_bias)
    if spec.sandwich_norms:
        h = h + norm(y, L.post_attention_layernorm)
        x = norm(h, L.pre_feedforward_layernorm)
    else:
        h = h + y
        x = norm(h, L.post_attention_layernorm)
    if L.experts:
        y = moe.moe_mlp(x, L, cfg.experts_per_token, cfg.norm_topk, ops, cfg.swiglu)
    else:
        y = ops.mlp(x, L.gate_up, L.down_proj, gelu=spec.activation == "gelu_tanh")
    return h + (norm(y, L.post_feedforward_layernorm) if spec.sandwich_norms else y)
