"""GGUF (llama.cpp) tensor names and architectures <-> Hugging Face's: the one map the importer reads
forwards and the exporter backwards.

A mixture of experts stores each layer's experts stacked, one [experts, rows, k] tensor per matrix
(`blk.{i}.ffn_gate_exps`); its Hugging Face name is a template with `{e}` in place of the expert,
and `expert_names` spells it out. Mixtral's files are GGUF architecture `llama` with an expert count.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from .architectures import PARAMETERS


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into a supported model."""


GGUF_MODEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's form of Llama 3's RoPE scaling: one divisor per frequency. It goes to config.json
# (`rope_freq_factors`, models/rope_scaling.py), not among the weights.
ROPE_FREQS = "rope_freqs.weight"
GGUF_LAYER_NAMES = {  # blk.{i}.{kind}.{weight|bias} -> model.layers.{i}.{module}.{weight|bias}
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma 3 has four norms per layer and q/k norms: llama.cpp's ffn_norm is its pre-FFN norm.
GEMMA3_LAYER_NAMES = {**GGUF_LAYER_NAMES, **QK_NORMS, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
QWEN3_LAYER_NAMES = {**GGUF_LAYER_NAMES, **QK_NORMS}


def _moe_names(router: str, experts: str, gate: str, up: str, down: str) -> dict[str, str]:
    return {"ffn_gate_inp": router, "ffn_gate_exps": f"{experts}.{{e}}.{gate}",
            "ffn_up_exps": f"{experts}.{{e}}.{up}", "ffn_down_exps": f"{experts}.{{e}}.{down}"}


_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
QWEN3MOE_LAYER_NAMES = {**{k: v for k, v in QWEN3_LAYER_NAMES.items() if k not in _DENSE_MLP},
                        **_moe_names("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")}
MIXTRAL_LAYER_NAMES = {**{k: v for k, v in GGUF_LAYER_NAMES.items() if k not in _DENSE_MLP},
                       **_moe_names("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")}
# gpt-oss: its post_attention_norm is the MLP's input norm; attention sinks (a parameter: no ".weight" on our side);
# the router and the stacked experts carry biases (ffn_gate_inp.bias, ffn_*_exps.bias [experts, rows])
GPT_OSS_LAYER_NAMES = {**{k: v for k, v in GGUF_LAYER_NAMES.items() if k not in (*_DENSE_MLP, "ffn_norm")},
                       "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                       **_moe_names("mlp.router", "mlp.experts", "gate_proj", "up_proj", "down_proj")}


@dataclass(frozen=True)
class GGUFArch:
    hf: str                 # the Hugging Face architecture
    model_type: str
    layers: dict[str, str]  # GGUF layer tensor -> Hugging Face module
    permuted: bool          # llama.cpp interleaves the rotary halves of q/k rows (`unpermute`)
    meta: str               # the prefix of its metadata keys (general.architecture)


ARCHS = {  # our key; Mistral's files are arch "llama", Mixtral's "llama" with experts (`architecture_key`)
    "llama": GGUFArch("LlamaForCausalLM", "llama", GGUF_LAYER_NAMES, True, "llama"),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", GGUF_LAYER_NAMES, False, "qwen2"),
    "gemma3": GGUFArch("Gemma3ForCausalLM", "gemma3_text", GEMMA3_LAYER_NAMES, False, "gemma3"),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", QWEN3_LAYER_NAMES, False, "qwen3"),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", QWEN3MOE_LAYER_NAMES, False, "qwen3moe"),
    "mixtral": GGUFArch("MixtralForCausalLM", "mixtral", MIXTRAL_LAYER_NAMES, True, "llama"),
    "gpt-oss": GGUFArch("GptOssForCausalLM", "gpt_oss", GPT_OSS_LAYER_NAMES, False, "gpt-oss"),
}


def architecture_key(meta: dict) -> str | None:
    """Our ARCHS key for a file's metadata (None: not one we read)."""
    arch = meta.get("general.architecture")
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        return "mixtral"
    return arch if arch in ARCHS and arch != "mixtral" else None


def arch_of(model_type: str) -> str:
    """Our ARCHS key for a config.json's model_type."""
    return next(a for a, spec in ARCHS.items() if spec.model_type == model_type)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of a model of our architecture `arch` (a template with
    `{e}` for a stacked experts' tensor); GGUFError where it has no place."""
    base, kind = gguf_name.rsplit(".", 1)
    if base in GGUF_MODEL_NAMES:
        return f"{GGUF_MODEL_NAMES[base]}.{kind}"
    parts = base.split(".")
    layer_names = ARCHS[arch].layers
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in layer_names:
        raise GGUFError(f"GGUF tensor {gguf_name} has no place in a {arch} model")
    module = layer_names[parts[2]]
    return f"model.layers.{parts[1]}.{module}" + ("" if module in PARAMETERS else f".{kind}")


def expert_names(name: str, experts: int) -> list[str]:
    """The Hugging Face names a (possibly stacked) tensor's name template stands for."""
    return [name.format(e=e) for e in range(experts)] if "{e}" in name else [name]


def gguf_name(name: str, arch: str) -> str | None:
    """The GGUF name of Hugging Face tensor `name` (an expert's: its stacked tensor's); None: no place."""
    base, kind = (name, "weight") if name.endswith(PARAMETERS) else name.rsplit(".", 1)
    model, layer = _inverse(arch)
    if base in model:
        return f"{model[base]}.{kind}"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    module = re.sub(r"\.experts\.\d+\.", ".experts.{e}.", m[2]) if m else None
    return f"blk.{m[1]}.{layer[module]}.{kind}" if m and module in layer else None


@functools.cache
def _inverse(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """Hugging Face -> GGUF names of the model's tensors and of a layer's, for `arch` (built once)."""
    return {v: k for k, v in GGUF_MODEL_NAMES.items()}, {v: k for k, v in ARCHS[arch].layers.items()}


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head; HF keeps them split (bias rows too).
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face q/k rows -> llama.cpp's (the rotary halves of each head interleaved; bias rows
    alike); the inverse of `unpermute`."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
