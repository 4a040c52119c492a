"""The encoder forward (BERT and nomic-bert), over texts laid one after another as rows, no padding.

One post-norm layer for both: q/k/v (fused into one linear), (RoPE for nomic-bert), bidirectional attention
over the text's own tokens, the output projection, residual, LayerNorm, the MLP (BERT: GELU between two
biased linears; nomic-bert: SwiGLU, no biases), residual, LayerNorm. Every numeric is an invariant kernel
(`kernels/encoder.py`, `kernels/invariant.py`), so a token's state is a function of its text alone.

Weights come by transformers' names (BertModel, NomicBertModel: transformers is the oracle): matrices packed
to bf16 once, LayerNorm weights bf16 (the RMSNorm kernel's), biases and embedding tables kept in fp32 as the
file holds them (an exact lookup, an fp32 add).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import encoder as ops
from ..kernels import invariant, rotary
from ..kernels.packing import PackedWeight, pack

ARCHITECTURES = ("bert", "nomic-bert")


@dataclass(frozen=True)
class EncoderConfig:
    arch: str  # "bert" (learned positions, GELU MLP, biases) or "nomic-bert" (RoPE, SwiGLU, no biases)
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int
    eps: float = 1e-12
    rope_theta: float = 1000.0  # nomic-bert only

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"encoder architecture {self.arch!r} is not supported ({', '.join(ARCHITECTURES)})")
        if self.hidden % self.heads or (self.hidden // self.heads) % 8:
            raise ValueError(f"hidden {self.hidden} / heads {self.heads}: the head size must be a multiple of 8")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_hf(cls, raw: dict) -> EncoderConfig:
        """From a transformers config.json (model_type bert or nomic_bert)."""
        kind = raw.get("model_type")
        if kind not in ("bert", "nomic_bert"):
            raise ValueError(f"model_type {kind!r} is not an encoder margingate runs (bert, nomic_bert)")
        if kind == "bert" and (raw.get("hidden_act", "gelu") != "gelu"
                               or raw.get("position_embedding_type", "absolute") != "absolute"):
            raise ValueError("BERT: only hidden_act gelu and absolute position embeddings are supported")
        theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 1000.0))
        return cls("bert" if kind == "bert" else "nomic-bert", raw["hidden_size"], raw["num_hidden_layers"],
                   raw["num_attention_heads"], raw["intermediate_size"], raw["vocab_size"],
                   raw["max_position_embeddings"], raw.get("layer_norm_eps", 1e-12), theta)


@dataclass
class EncoderLayer:
    qkv: PackedWeight
    qkv_bias: torch.Tensor | None
    out: PackedWeight
    out_bias: torch.Tensor | None
    norm1: tuple[torch.Tensor, torch.Tensor]  # (weight bf16, bias fp32)
    up: PackedWeight  # BERT: the intermediate dense; nomic-bert: gate | up fused
    up_bias: torch.Tensor | None
    down: PackedWeight
    down_bias: torch.Tensor | None
    norm2: tuple[torch.Tensor, torch.Tensor]


def _norm(state: dict, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    return state[f"{prefix}.weight"].to(torch.bfloat16), state[f"{prefix}.bias"].float()


def _bert_layer(state: dict, p: str) -> EncoderLayer:
    a = f"{p}.attention.self"
    qkv = torch.cat([state[f"{a}.{n}.weight"] for n in ("query", "key", "value")])
    qkv_bias = torch.cat([state[f"{a}.{n}.bias"] for n in ("query", "key", "value")]).float()
    out = f"{p}.attention.output"
    return EncoderLayer(pack(qkv), qkv_bias, pack(state[f"{out}.dense.weight"]), state[f"{out}.dense.bias"].float(),
                        _norm(state, f"{out}.LayerNorm"),
                        pack(state[f"{p}.intermediate.dense.weight"]), state[f"{p}.intermediate.dense.bias"].float(),
                        pack(state[f"{p}.output.dense.weight"]), state[f"{p}.output.dense.bias"].float(),
                        _norm(state, f"{p}.output.LayerNorm"))


def _nomic_layer(state: dict, p: str) -> EncoderLayer:
    a, m = f"{p}.self_attn", f"{p}.mlp"
    qkv = torch.cat([state[f"{a}.{n}_proj.weight"] for n in ("q", "k", "v")])
    gate_up = torch.cat([state[f"{m}.gate_proj.weight"], state[f"{m}.up_proj.weight"]])  # silu_mul's (gate | up)
    return EncoderLayer(pack(qkv), None, pack(state[f"{a}.o_proj.weight"]), None,
                        _norm(state, f"{p}.post_attention_layernorm"), pack(gate_up), None,
                        pack(state[f"{m}.down_proj.weight"]), None, _norm(state, f"{p}.post_mlp_layernorm"))


class EncoderModel:
    def __init__(self, config: EncoderConfig, state: dict[str, torch.Tensor]):
        """`state`: tensors by transformers' names (BertModel's or NomicBertModel's, no model prefix); a
        missing one is a KeyError naming it."""
        self.config = config
        bert = config.arch == "bert"
        self.word = state["embeddings.word_embeddings.weight"].float()
        self.token_type = state["embeddings.token_type_embeddings.weight"][0].float()  # every token is segment 0
        self.position = state["embeddings.position_embeddings.weight"].float() if bert else None
        self.embed_norm = _norm(state, "embeddings.LayerNorm")
        self.layers = [_bert_layer(state, f"encoder.layer.{i}") if bert else _nomic_layer(state, f"layers.{i}")
                       for i in range(config.layers)]
        self.rotary = None if bert else rotary.RotaryTable(config.head_dim, config.rope_theta)

    @torch.inference_mode()
    def forward(self, texts: list[list[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The last layer's hidden states [sum of lengths, hidden] in `dtype`: text after text, token by token."""
        cfg, lengths = self.config, [len(t) for t in texts]
        ids = torch.tensor([i for t in texts for i in t], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lengths])
        h = self.word[ids] + self.token_type  # BERT's order: (word + type) + position, in fp32
        if self.position is not None:
            h = h + self.position[positions]
        h = ops.layer_norm(h, *self.embed_norm, cfg.eps).to(dtype)
        rope = self.rotary.lookup(positions, dtype) if self.rotary else None
        for layer in self.layers:
            h = self._layer(layer, h, lengths, rope)
        return h

    def _layer(self, L: EncoderLayer, h: torch.Tensor, lengths: list[int], rope) -> torch.Tensor:
        cfg, n = self.config, h.shape[0]
        q, k, v = invariant.linear(h, L.qkv, L.qkv_bias).view(n, 3, cfg.heads, cfg.head_dim).unbind(1)
        if rope is not None:
            q, k = rotary.rotate(q, *rope), rotary.rotate(k, *rope)
        attn = ops.bidirectional_attention(q.contiguous(), k, v, lengths, 1.0 / math.sqrt(cfg.head_dim))
        h = ops.layer_norm(h + invariant.linear(attn.reshape(n, -1), L.out, L.out_bias), *L.norm1, cfg.eps)
        up = invariant.linear(h, L.up, L.up_bias)
        act = invariant.silu_mul(up) if cfg.arch == "nomic-bert" else ops.gelu(up)
        return ops.layer_norm(h + invariant.linear(act, L.down, L.down_bias), *L.norm2, cfg.eps)
