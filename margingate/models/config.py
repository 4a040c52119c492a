"""Model shape, read from a Hugging Face config.json."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields

from .architectures import ARCHITECTURES

GEMMA_FIELDS = ("layer_windows", "rope_local_theta", "query_pre_attn_scalar")


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
        gemma = _gemma3_fields(raw, name) if architecture == "Gemma3ForCausalLM" else {}
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

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window; 0: it attends over every earlier position."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def fingerprint(self) -> str:
        """The shape and name (profiles and measurement caches are keyed by it). `architecture` is
        left out, as it was before it became a field: the fingerprints of existing models stay."""
        fields = asdict(self)
        del fields["architecture"]
        defaults = {f.name: f.default for f in dataclass_fields(self)}
        for name in GEMMA_FIELDS:  # absent from the Llama family's fingerprints, as before they existed
            if fields[name] == defaults[name]:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


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
