"""Each architecture, described once: its decoder layer (`LayerSpec`), which tensors it has and how their
Hugging Face names map to ours. Plain data that the config (which architectures exist, whether they carry
biases), the weights (the names to read) and both forwards (the layer) use."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..kernels.layer_spec import LayerSpec


@dataclass(frozen=True)
class MoeNames:
    """Where an MoE layer's tensors live under `model.layers.{i}.`: the router, and per expert e the
    gate, up and down matrices under `{experts}.{e}.`. `gpt_oss`: the router and every expert matrix carry a
    bias, the route takes the top-k of the logits before their softmax, the experts gate with the clamped
    SwiGLU, and the checkpoint stores the experts fused (`fused_experts.py` splits them into these names)."""
    router: str
    experts: str
    gate: str
    up: str
    down: str
    gpt_oss: bool = False


@dataclass(frozen=True)
class Architecture:
    attention_bias: bool | None  # fixed by the architecture; None: config.json's `attention_bias` (default false)
    biased: tuple[str, ...]      # our projections that carry a bias when attention_bias holds
    layer: LayerSpec = field(default_factory=LayerSpec)  # the decoder layer's switches
    moe: MoeNames | None = None  # a mixture-of-experts MLP (models/moe.py) in its MoE layers

    def __post_init__(self):
        if self.moe and self.layer.activation != "silu":  # the experts' kernels gate with SiLU (moe.py, moe.cpp)
            raise ValueError(f"a mixture of experts with {self.layer.activation} experts is not implemented")

    @property
    def extra(self) -> tuple[str, ...]:
        """Layer tensors beyond LAYER_MAP's (keys of EXTRA_LAYER_MAP): the layer's extra norms, its sinks."""
        return self.layer.extra_norms + (("sinks",) if self.layer.attention_sinks else ())


# The q/k norms (Qwen3, Gemma 3) and Gemma 3's norms around the MLP (LayerSpec.extra_norms).
EXTRA_LAYER_MAP = {
    "q_norm": ("self_attn.q_norm",),
    "k_norm": ("self_attn.k_norm",),
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm",),
    "post_feedforward_layernorm": ("post_feedforward_layernorm",),
    "sinks": ("self_attn.sinks",),  # a parameter, not a module: no ".weight" (PARAMETERS)
}
PARAMETERS = ("self_attn.sinks",)  # map entries that name a tensor itself

QK_NORMED = LayerSpec(qk_norm=True)
# Gemma 3: (1 + w) norms, q/k norms, the attention and MLP outputs normed before their residual adds,
# GELU-tanh, embeddings scaled by sqrt(hidden).
GEMMA3_LAYER = LayerSpec(unit_offset_norms=True, qk_norm=True, sandwich_norms=True, activation="gelu_tanh",
                         embed_scale=True)

ARCHITECTURES = {  # as transformers builds them
    "LlamaForCausalLM": Architecture(attention_bias=None, biased=("qkv", "o_proj")),
    "MistralForCausalLM": Architecture(attention_bias=False, biased=()),
    "Qwen2ForCausalLM": Architecture(attention_bias=True, biased=("qkv",)),
    "Gemma3ForCausalLM": Architecture(attention_bias=False, biased=(), layer=GEMMA3_LAYER),
    # Qwen3: the Llama layer with q and k RMS-normed per head before RoPE (plain weights, not Gemma's 1 + w)
    "Qwen3ForCausalLM": Architecture(attention_bias=None, biased=("qkv", "o_proj"), layer=QK_NORMED),
    "Qwen3MoeForCausalLM": Architecture(attention_bias=None, biased=("qkv", "o_proj"), layer=QK_NORMED,
                                        moe=MoeNames("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": Architecture(attention_bias=False, biased=(), moe=MoeNames(
        "block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding layers (config), YaRN (config), and a biased MoE with
    # its own route and clamped SwiGLU in every layer
    "GptOssForCausalLM": Architecture(attention_bias=None, biased=("qkv", "o_proj"),
                                      layer=LayerSpec(attention_sinks=True, fp32_norm_product=True),
                                      moe=MoeNames("mlp.router", "mlp.experts", "gate_proj", "up_proj", "down_proj",
                                                   gpt_oss=True)),
}

# Our tensors of layer i -> the Hugging Face modules under `model.layers.{i}.`, in concatenation order.
LAYER_MAP = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
    "input_layernorm": ("input_layernorm",),
    "post_attention_layernorm": ("post_attention_layernorm",),
}
MODEL_MAP = {"embed": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
# Buffers older checkpoints carry that the forward recomputes: read past, never used.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
