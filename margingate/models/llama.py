"""Llama-family forward (Llama, Mistral, Qwen2) over rows of (slot, position, token).

The model knows nothing of requests: a forward gets N rows and an attention
plan saying which kernel each row uses, writes every row's K/V into the cache,
and returns the rows' logits. Numerics follow Hugging Face's implementation
(RMSNorm in fp32, rotary tables cast to the activation dtype) so that
`transformers` can serve as the oracle in tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels import attention
from ..kv_cache import KVCache
from .config import ModelConfig

_LAYER_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "input_layernorm", "post_attention_layernorm")


@dataclass
class AttentionPlan:
    """How the rows of one forward attend. Row indices refer to the forward's rows.

    `prefill`: all rows are one request's prompt, positions 0..L-1, causal.
    `batched`: rows that share one padded SDPA call (one row per request).
    `exact`: rows that each attend over exactly their own prefix.
    """
    prefill: bool = False
    batched: list[int] = field(default_factory=list)
    exact: list[int] = field(default_factory=list)


class _Rows:
    """The plan turned into slots, lengths, indices and the padding mask, once per forward
    rather than once per layer (each costs host syncs and small ops)."""

    def __init__(self, plan: AttentionPlan, slots: torch.Tensor, positions: torch.Tensor):
        slot_list, pos_list = slots.tolist(), positions.tolist()
        self.prefill = (slot_list[0], len(pos_list)) if plan.prefill else None
        self.exact = [(r, slot_list[r], pos_list[r] + 1) for r in plan.exact]
        self.exact_idx = torch.tensor(plan.exact, device=slots.device)
        self.batched = None
        if plan.batched:
            rs = [slot_list[r] for r in plan.batched]
            lengths = [pos_list[r] + 1 for r in plan.batched]
            lmax = max(lengths)
            consecutive = rs == list(range(rs[0], rs[0] + len(rs)))
            gather = None if consecutive else torch.tensor(rs, device=slots.device)
            mask = attention.length_mask(torch.tensor(lengths, device=slots.device), lmax)
            self.batched = (torch.tensor(plan.batched, device=slots.device), rs[0], rs[0] + len(rs), gather, lmax,
                            mask)


class Linear:
    """The one linear kernel of the model, written so that every row is computed
    the same way whatever the number of rows (row-independence).

    bf16 on CPU: oneDNN sends a single row (M=1) to a GEMV that accumulates in
    another order than its M>=2 GEMM (visible for K > 1024, e.g. down_proj), so a
    single row is padded to two. fp32 GEMM rows differ between M=1, 2-4 and >=5,
    so a row-independent fp32 pass (`rowwise`) computes one row per call.
    """

    @staticmethod
    def apply(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rowwise: bool) -> torch.Tensor:
        if rowwise and x.shape[0] > 1:
            return torch.cat([F.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
        if x.shape[0] == 1 and x.dtype == torch.bfloat16:
            return F.linear(torch.cat((x, x)), w, b)[:1]
        return F.linear(x, w, b)


class LlamaModel:
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self._weights = {torch.bfloat16: self._collect(state)}
        inv_freq = 1.0 / (config.rope_theta ** (
            torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=self.device) / config.head_dim))
        self._inv_freq = inv_freq

    def _collect(self, state: dict[str, torch.Tensor]) -> dict:
        dev = self.device
        w = {"embed": state["model.embed_tokens.weight"].to(dev), "norm": state["model.norm.weight"].to(dev)}
        w["lm_head"] = state["lm_head.weight"].to(dev) if "lm_head.weight" in state else w["embed"]
        w["layers"] = []
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            layer = {}
            for name in _LAYER_WEIGHTS:
                sub = "self_attn." if name.endswith("_proj") and name[0] in "qkvo" else \
                      "mlp." if name.endswith("_proj") else ""
                layer[name] = state[p + sub + name + ".weight"].to(dev)
            for name in ("q_proj", "k_proj", "v_proj"):
                bias = state.get(p + "self_attn." + name + ".bias")
                layer[name + ".bias"] = None if bias is None else bias.to(dev)
            w["layers"].append(layer)
        return w

    def weights(self, dtype: torch.dtype) -> dict:
        """Weights in `dtype`; an fp32 copy is made on first use (fp32 verifier)."""
        if dtype not in self._weights:
            base = self._weights[torch.bfloat16]
            cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
            self._weights[dtype] = {
                "embed": cast(base["embed"]), "norm": cast(base["norm"]), "lm_head": cast(base["lm_head"]),
                "layers": [{k: cast(v) for k, v in layer.items()} for layer in base["layers"]],
            }
        return self._weights[dtype]

    # --- pieces ------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return weight * h.to(x.dtype)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables for these positions, computed once per forward."""
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, D]. Rotates the two halves of each head (HF layout)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    # --- forward -----------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                plan: AttentionPlan, kv: KVCache, *, dtype: torch.dtype = torch.bfloat16,
                rowwise: bool = False, logits_rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """Run N rows through the model; returns fp32 logits of `logits_rows` (default all)."""
        cfg, W = self.config, self.weights(dtype)
        n = tokens.shape[0]
        lin = lambda x, w, b=None: Linear.apply(x, w, b, rowwise)  # noqa: E731
        h = F.embedding(tokens, W["embed"])
        cos, sin = self._rotary(positions, h.dtype)
        rows = _Rows(plan, slots, positions)
        for li, L in enumerate(W["layers"]):
            x = self._rms_norm(h, L["input_layernorm"])
            q = lin(x, L["q_proj"], L["q_proj.bias"]).view(n, cfg.num_heads, cfg.head_dim)
            k = lin(x, L["k_proj"], L["k_proj.bias"]).view(n, cfg.num_kv_heads, cfg.head_dim)
            v = lin(x, L["v_proj"], L["v_proj.bias"]).view(n, cfg.num_kv_heads, cfg.head_dim)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kv.write(li, slots, positions, k, v)
            attn = self._attend(li, q, rows, kv, dtype)
            h = h + lin(attn.reshape(n, -1), L["o_proj"])
            x = self._rms_norm(h, L["post_attention_layernorm"])
            h = h + lin(F.silu(lin(x, L["gate_proj"])) * lin(x, L["up_proj"]), L["down_proj"])
        if logits_rows is not None:
            h = h[logits_rows]
        h = self._rms_norm(h, W["norm"])
        return lin(h, W["lm_head"]).float()

    def _attend(self, layer: int, q: torch.Tensor, rows: "_Rows", kv: KVCache, dtype: torch.dtype) -> torch.Tensor:
        K, V = kv.k[layer], kv.v[layer]
        cast = (lambda t: t) if K.dtype == dtype else (lambda t: t.to(dtype))  # noqa: E731
        if rows.prefill is not None:
            s, length = rows.prefill
            return attention.prefill(q, cast(K[s, :, :length]), cast(V[s, :, :length]))
        out = torch.empty_like(q)
        if rows.batched is not None:
            idx, lo, hi, gather, lmax, mask = rows.batched
            if gather is None:  # consecutive slots: views, no copy
                kb, vb = K[lo:hi, :, :lmax], V[lo:hi, :, :lmax]
            else:
                kb, vb = K[gather, :, :lmax], V[gather, :, :lmax]
            out[idx] = attention.batched(q[idx], cast(kb), cast(vb), mask)
        if rows.exact:
            qs = q.unbind(0)
            done = [attention.exact(qs[r], cast(K[s, :, :n]), cast(V[s, :, :n])) for r, s, n in rows.exact]
            out[rows.exact_idx] = torch.stack(done)
        return out
