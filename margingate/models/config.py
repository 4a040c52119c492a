"""Model shape, read from a Hugging Face config.json."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields

from ..kernels.layer_spec import LayerSpec
from . import rope_scaling
from .architectures import ARCHITECTURES

# Fields absent from the fingerprint at their defaults, as before they existed: old fingerprints stay.
OPTIONAL_FIELDS = ("layer_windows", "rope_local_theta", "query_pre_attn_scalar", "rope_scaling", "rope_freq_factors",
                   "num_experts", "experts_per_token", "moe_intermediate", "norm_topk", "moe_layers", "swiglu")

# Every key transformers' configs of our architectures hold, by what our forward does with it; a test
# (tests/test_config_fields.py) fails on a key in none of them, so no field that changes the forward
# is ignored without a word. READ: from_hf uses it. NO_FORWARD: bookkeeping, generation or training
# only (dropout is off at inference; pretraining_tp only splits a matmul; max_window_layers acts only with
# use_sliding_window, which is refused). REFUSED: a feature we do not
# implement, refused by name unless it is off (_refuse_unimplemented; Gemma 3's in _gemma3_fields).
READ = {"architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "attention_bias", "eos_token_id", "layer_types",
        "sliding_window", "_sliding_window_pattern", "sliding_window_pattern", "rope_local_base_freq",
        "query_pre_attn_scalar", "rope_freq_factors", "num_experts", "num_local_experts", "num_experts_per_tok",
        "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "swiglu_alpha",
        "swiglu_limit"}
NO_FORWARD = {"_name_or_path", "model_type", "dtype", "torch_dtype", "transformers_version", "bos_token_id",
              "pad_token_id", "initializer_range", "use_cache", "attention_dropout", "pretraining_tp",
              "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
              "output_hidden_states", "problem_type", "return_dict", "output_router_logits", "router_aux_loss_coef",
              "router_jitter_noise", "max_window_layers"}
REFUSED = {"hidden_act", "hidden_activation", "mlp_bias", "use_sliding_window", "quantization_config",
           "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention", "partial_rotary_factor"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool  # lm_head is the embedding matrix (the folder needs no lm_head.weight)
    attention_bias: bool  # the projections ARCHITECTURES names carry biases (Qwen2: always)
    eos_token_ids: tuple[int, ...]
    architecture: str = "LlamaForCausalLM"  # picks the weight name map (models/weights.py)
    # Gemma 3 only (the defaults are the Llama family's, and leave the fingerprint as it was):
    layer_windows: tuple[int, ...] = ()   # per layer, its sliding window (0: full attention)
    rope_local_theta: float = 0.0         # the sliding layers' RoPE base
    query_pre_attn_scalar: float = 0.0    # attention scale 1/sqrt(this); 0: 1/sqrt(head_dim)
    # RoPE scaling (models/rope_scaling.py): ("llama3", factor, low_freq_factor, high_freq_factor, original
    # context) or ("linear", factor) from config.json; or a GGUF's per-frequency divisors (its rope_freqs)
    rope_scaling: tuple = ()
    rope_freq_factors: tuple[float, ...] = ()
    # Mixture of experts (models/moe.py): the layers whose MLP is one, and its shape
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    norm_topk: bool = False  # the kept weights divided by their sum
    moe_layers: tuple[int, ...] = ()
    swiglu: tuple[float, ...] = ()  # gpt-oss's experts: the clamped SwiGLU's (alpha, limit)

    @classmethod
    def from_hf(cls, raw: dict, name: str) -> ModelConfig:
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id", [])
        eos = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
        rope = raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {architecture} is not supported (supported: {', '.join(ARCHITECTURES)})")
        bias = ARCHITECTURES[architecture].attention_bias
        if architecture == "Gemma3ForCausalLM":
            gemma = _gemma3_fields(raw, name)
        elif architecture == "GptOssForCausalLM":
            gemma = _gpt_oss_fields(raw, name)
        else:
            _refuse_unimplemented(raw, name)
            gemma = {"rope_scaling": rope_scaling.parse(raw, name),
                     "rope_freq_factors": tuple(float(f) for f in raw.get("rope_freq_factors") or ()),
                     **_moe_fields(raw, name, architecture)}
        rope = gemma.pop("rope_theta", rope)  # Gemma: the full-attention layers' base
        return cls(
            name=name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=float(rope),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=raw.get("max_position_embeddings", 4096),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)) if bias is None else bias,
            eos_token_ids=eos,
            architecture=architecture,
            **gemma,
        )

    @property
    def attention_scale(self) -> float:
        """As transformers computes it: Llama 1 / sqrt(head_dim), Gemma query_pre_attn_scalar ** -0.5."""
        if self.query_pre_attn_scalar:
            return self.query_pre_attn_scalar ** -0.5
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def layer(self) -> LayerSpec:
        """The architecture's decoder layer (architectures.py)."""
        return ARCHITECTURES[self.architecture].layer

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window; 0: it attends over every earlier position."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def fingerprint(self) -> str:
        """The shape and name (profiles and measurement caches are keyed by it). `architecture` is
        left out, as it was before it became a field: the fingerprints of existing models stay."""
        fields = asdict(self)
        del fields["architecture"]
        defaults = {f.name: f.default for f in dataclass_fields(self)}
        for name in OPTIONAL_FIELDS:  # absent from the fingerprints at their defaults, as before they existed
            if fields[name] == defaults[name]:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _refuse_unimplemented(raw: dict, name: str) -> None:
    """The Llama family's forward-changing fields we do not implement, refused by name unless off."""
    off = {"hidden_act": ("silu", None), "mlp_bias": (False, None), "use_sliding_window": (False, None),
           "partial_rotary_factor": (1, 1.0, None)}
    for key, allowed in off.items():
        if raw.get(key) not in allowed:
            raise ValueError(f"{name}: {key} = {raw[key]!r} is not supported (only {allowed[0]!r})")
    # Mistral attends over a window whenever sliding_window is set; Qwen2 / 3 only with use_sliding_window (refused)
    window, top = raw.get("sliding_window"), raw.get("max_position_embeddings", 4096)
    if raw.get("model_type") not in ("qwen2", "qwen3", "qwen3_moe") and window is not None and window < top:
        raise ValueError(f"{name}: sliding_window = {window} below max_position_embeddings = {top} (windowed "
                         "attention in every layer) is not supported")
    types = set(raw.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        raise ValueError(f"{name}: layer_types {sorted(types)} are not supported (only full_attention)")


def _moe_fields(raw: dict, name: str, architecture: str) -> dict:
    """A mixture of experts' shape: every layer's MLP for Mixtral; for Qwen3-MoE every decoder_sparse_step-th
    layer not in mlp_only_layers. An expert count below 1 or a top-k outside 1..experts is refused."""
    if ARCHITECTURES[architecture].moe is None:
        return {}
    experts, k = raw.get("num_experts", raw.get("num_local_experts")), raw.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"{name}: {architecture} needs at least one expert (num_experts = {experts!r})")
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"{name}: num_experts_per_tok = {k!r} must lie in 1..{experts} (the experts)")
    n = raw["num_hidden_layers"]
    if architecture in ("MixtralForCausalLM", "GptOssForCausalLM"):  # every layer; gpt-oss normalizes in its route
        return {"num_experts": experts, "experts_per_token": k, "moe_intermediate": raw["intermediate_size"],
                "norm_topk": architecture == "MixtralForCausalLM", "moe_layers": tuple(range(n))}
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{name}: decoder_sparse_step = {step!r} must be at least 1")
    return {"num_experts": experts, "experts_per_token": k, "moe_intermediate": raw["moe_intermediate_size"],
            "norm_topk": bool(raw.get("norm_topk_prob", False)),
            "moe_layers": tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)}


def _gemma3_fields(raw: dict, name: str) -> dict:
    """Gemma 3's sliding windows, its two RoPE bases and attention scale, from either config style:
    transformers 5's (`layer_types`, `rope_parameters` per layer type) or the older one
    (`sliding_window_pattern`, `rope_theta` and `rope_local_base_freq`). What our forward does not
    implement (logit soft-capping, RoPE scaling, bidirectional attention) is refused by name."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "rope_scaling"):
        if raw.get(key) is not None:
            raise ValueError(f"{name}: Gemma 3 with {key} = {raw[key]!r} is not supported")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{name}: Gemma 3 with hidden_activation {raw['hidden_activation']!r} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{name}: Gemma 3 with bidirectional attention is not a causal LM")
    n = raw["num_hidden_layers"]
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    types = raw.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                       for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{name}: layer_types must name full_attention or sliding_attention for each of {n} layers")
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or {"rope_theta": raw.get("rope_theta", 1_000_000.0)}
    local = params.get("sliding_attention") or {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    for kind, p in (("full_attention", full), ("sliding_attention", local)):
        if p.get("rope_type", "default") != "default":
            raise ValueError(f"{name}: Gemma 3 with {p['rope_type']} RoPE scaling ({kind} layers) is not supported")
    window = int(raw.get("sliding_window") or 0)
    return {"layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
            "rope_theta": float(full["rope_theta"]), "rope_local_theta": float(local["rope_theta"]),
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 0)}


def _gpt_oss_fields(raw: dict, name: str) -> dict:
    """gpt-oss: sliding layers as `layer_types` says (one RoPE for all), YaRN or plain RoPE, a mixture of experts
    in every layer with its clamped SwiGLU's (alpha, limit). A quantized folder (transformers' MXFP4
    `quantization_config`) is refused by name: its GGUF is the quantized route."""
    if raw.get("quantization_config"):
        raise ValueError(f"{name}: quantization_config {raw['quantization_config'].get('quant_method', '?')!r} is "
                         "not supported in a Hugging Face folder (load the model's GGUF, or a bf16 folder)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act = {raw['hidden_act']!r} is not supported (only 'silu')")
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"{name}: layer_types must name full_attention or sliding_attention for each of {n} layers")
    window = int(raw.get("sliding_window") or 0)
    if "sliding_attention" in types and window < 1:
        raise ValueError(f"{name}: sliding_attention layers need a sliding_window >= 1 (got {window})")
    return {"layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
            "rope_scaling": rope_scaling.parse(raw, name), **_moe_fields(raw, name, "GptOssForCausalLM"),
            "swiglu": (float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0)))}
