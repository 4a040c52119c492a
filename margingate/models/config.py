"""Model shape, read from a Hugging Face config.json."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from .weights import ARCHITECTURES


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
        )

    def fingerprint(self) -> str:
        """The shape and name (profiles and measurement caches are keyed by it). `architecture` is
        left out, as it was before it became a field: the fingerprints of existing models stay."""
        fields = asdict(self)
        del fields["architecture"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
