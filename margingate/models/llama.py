"""Llama-family forward (Llama, Mistral, Qwen2) over rows of (slot, position, token).

The model knows nothing of requests: a forward gets N rows and an attention plan
saying which rows attend exactly (over their own cached prefix, the invariant
kernel) and which share one padded batched call (the library kernel), writes
every row's K/V into the cache, and returns the rows' logits. `invariant=True`
runs every Linear, norm and activation through the invariant kernels too; then
each row's K/V and logits are a function of its tokens alone.

Numerics follow Hugging Face's implementation (RMSNorm in fp32, rotary tables cast
to the activation dtype, bf16 logits) so that `transformers` is the oracle in tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels import invariant as invariant_kernels
from ..kernels import library as library_kernels
from ..kv_cache import KVCache
from .config import ModelConfig


@dataclass
class AttentionPlan:
    """How the rows of one forward attend. Row indices refer to the forward's rows.

    `exact`: each row attends over keys [0, its position] of its own slot (prompt rows,
    chunks, decode rows and verifier rows alike: one kernel, so they agree bitwise).
    `batched`: decode rows (one per request) sharing one padded SDPA call.
    """
    exact: list[int] = field(default_factory=list)
    batched: list[int] = field(default_factory=list)

    @classmethod
    def all_exact(cls, n: int) -> AttentionPlan:
        return cls(exact=list(range(n)))


class _Rows:
    """The plan as index tensors, built once per forward rather than once per layer."""

    def __init__(self, plan: AttentionPlan, slots: torch.Tensor, positions: torch.Tensor):
        dev = slots.device
        self.exact = None
        if plan.exact:
            idx = torch.tensor(plan.exact, device=dev)
            self.exact = (idx, slots[idx], positions[idx] + 1, len(plan.exact) == slots.shape[0])
        self.batched = None
        if plan.batched:
            slot_list, pos_list = slots.tolist(), positions.tolist()
            rs = [slot_list[r] for r in plan.batched]
            lengths = [pos_list[r] + 1 for r in plan.batched]
            lmax = max(lengths)
            consecutive = rs == list(range(rs[0], rs[0] + len(rs)))
            gather = None if consecutive else torch.tensor(rs, device=dev)
            mask = library_kernels.length_mask(torch.tensor(lengths, device=dev), lmax)
            self.batched = (torch.tensor(plan.batched, device=dev), rs[0], rs[0] + len(rs), gather, lmax, mask)


class _RotaryTable:
    """cos/sin of every position, each value computed on its own (Python's libm, double, then
    rounded to fp32): a position's entry never depends on how many positions a forward holds
    or on the thread count (a vectorized library cos treats a tensor's tail differently)."""

    def __init__(self, head_dim: int, theta: float):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.inv_freq = (1.0 / (theta ** exponents)).tolist()
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.size = 0

    def _grow(self, n: int) -> None:
        size = max(256, 1 << (n - 1).bit_length())
        angles = (torch.arange(size, dtype=torch.float32)[:, None] * torch.tensor(self.inv_freq)[None, :]).tolist()
        cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float32)
        sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float32)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        self.tables = {torch.float32: (cos, sin)}
        self.size = size

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, D] cos and sin for these positions, in `dtype`."""
        top = int(positions.max()) + 1
        if top > self.size:
            self._grow(top)
        if dtype not in self.tables:
            cos, sin = self.tables[torch.float32]
            self.tables[dtype] = (cos.to(dtype), sin.to(dtype))
        cos, sin = self.tables[dtype]
        return cos[positions][:, None], sin[positions][:, None]


def _fused_bias(biases: list[torch.Tensor | None], weights: list[torch.Tensor],
                device: torch.device) -> torch.Tensor | None:
    """The bias of fused projections (q|k|v): a part without one gets zeros."""
    if all(b is None for b in biases):
        return None
    return torch.cat([torch.zeros(w.shape[0], dtype=w.dtype) if b is None else b.to(w.dtype)
                      for b, w in zip(biases, weights)]).to(device)


class LlamaModel:
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self._weights = {torch.bfloat16: self._collect(state)}
        self._rotary = _RotaryTable(config.head_dim, config.rope_theta)

    def _collect(self, state: dict[str, torch.Tensor]) -> dict:
        dev = self.device
        w = {"embed": state["model.embed_tokens.weight"].to(dev), "norm": state["model.norm.weight"].to(dev)}
        w["lm_head"] = state["lm_head.weight"].to(dev) if "lm_head.weight" in state else w["embed"]
        w["layers"] = []
        for i in range(self.config.num_layers):
            attn, mlp, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
            qkv = [state[attn + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")]
            biases = [state.get(attn + n + ".bias") for n in ("q_proj", "k_proj", "v_proj")]
            w["layers"].append({
                "qkv": torch.cat(qkv).to(dev),
                "qkv.bias": _fused_bias(biases, qkv, dev),
                "o_proj": state[attn + "o_proj.weight"].to(dev),
                "gate_up": torch.cat([state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]).to(dev),
                "down_proj": state[mlp + "down_proj.weight"].to(dev),
                "input_layernorm": state[p + "input_layernorm.weight"].to(dev),
                "post_attention_layernorm": state[p + "post_attention_layernorm.weight"].to(dev),
            })
        return w

    def weights(self, dtype: torch.dtype) -> dict:
        """Weights in `dtype`; an fp32 copy is made on first use (LayerCast's library fp32 path)."""
        if dtype not in self._weights:
            base = self._weights[torch.bfloat16]
            cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
            self._weights[dtype] = {
                "embed": cast(base["embed"]), "norm": cast(base["norm"]), "lm_head": cast(base["lm_head"]),
                "layers": [{k: cast(v) for k, v in layer.items()} for layer in base["layers"]],
            }
        return self._weights[dtype]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, D]. Rotates the two halves of each head (HF layout). Elementwise ops
        only, each rounded once: the same bits for a position in any forward."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    # --- forward -----------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                plan: AttentionPlan, kv: KVCache, *, dtype: torch.dtype = torch.bfloat16,
                invariant: bool = True, logits_rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Run N rows through the model; returns fp32 logits of `logits_rows` (default all).

        `invariant`: every Linear, norm and activation through the invariant kernels (bf16
        weights; `dtype` is the activations'). Otherwise the library's, with weights in `dtype`.
        """
        cfg = self.config
        ops = invariant_kernels if invariant else library_kernels
        W = self.weights(torch.bfloat16 if invariant else dtype)
        n, eps = tokens.shape[0], cfg.rms_eps
        h = F.embedding(tokens, W["embed"]).to(dtype)
        cos, sin = self._rotary.lookup(positions, dtype)
        rows = _Rows(plan, slots, positions)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for li, L in enumerate(W["layers"]):
            x = ops.rmsnorm(h, L["input_layernorm"], eps)
            q, k, v = ops.linear(x, L["qkv"], L["qkv.bias"]).split((q_size, kv_size, kv_size), dim=-1)
            q = self._rope(q.reshape(n, cfg.num_heads, cfg.head_dim), cos, sin)
            k = self._rope(k.reshape(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            kv.write(li, slots, positions, k, v.reshape(n, cfg.num_kv_heads, cfg.head_dim))
            attn = self._attend(li, q, rows, kv, dtype)
            h = h + ops.linear(attn.reshape(n, -1), L["o_proj"])
            x = ops.rmsnorm(h, L["post_attention_layernorm"], eps)
            h = h + ops.linear(ops.silu_mul(ops.linear(x, L["gate_up"])), L["down_proj"])
        if logits_rows is not None:
            h = h[logits_rows]
        h = ops.rmsnorm(h, W["norm"], eps)
        return ops.linear(h, W["lm_head"]).float()

    def _attend(self, layer: int, q: torch.Tensor, rows: _Rows, kv: KVCache, dtype: torch.dtype) -> torch.Tensor:
        K, V = kv.k[layer], kv.v[layer]
        scale = 1.0 / math.sqrt(self.config.head_dim)
        if rows.exact is not None and rows.exact[3]:  # every row exact: no scatter
            _, slots, lengths, _ = rows.exact
            return invariant_kernels.attention(q, K, V, slots, lengths, scale)
        out = torch.empty_like(q)
        if rows.exact is not None:
            idx, slots, lengths, _ = rows.exact
            out[idx] = invariant_kernels.attention(q[idx], K, V, slots, lengths, scale)
        if rows.batched is not None:
            idx, lo, hi, gather, lmax, mask = rows.batched
            if gather is None:  # consecutive slots: views, no copy
                kb, vb = K[lo:hi, :, :lmax], V[lo:hi, :, :lmax]
            else:
                kb, vb = K[gather, :, :lmax], V[gather, :, :lmax]
            if kb.dtype != dtype:
                kb, vb = kb.to(dtype), vb.to(dtype)
            out[idx] = library_kernels.batched_attention(q[idx], kb, vb, mask)
        return out
