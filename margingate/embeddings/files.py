"""An encoder's files read into what the embedder needs: its config, tensors by transformers' names, its
tokenizer and how it pools. From a Hugging Face folder with sentence-transformers' files (in a zip, as
all-MiniLM-L6-v2 ships, or on disk), or from a GGUF (llama.cpp's `bert` and `nomic-bert` files)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .encoder import EncoderConfig

POOLINGS = ("mean", "cls", "last")
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
               "pooling_mode_lasttoken": "last"}
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE


@dataclass
class EncoderFiles:
    config: EncoderConfig
    state: dict[str, torch.Tensor]
    tokenizer: object  # a `tokenizers.Tokenizer` that adds [CLS] ... [SEP], no padding, no truncation
    pooling: str = "mean"
    normalize: bool = True
    max_tokens: int = 512


def st_pooling(files: dict[str, bytes]) -> tuple[str, bool]:
    """sentence-transformers' pooling mode and whether a Normalize module follows (modules.json)."""
    pooling = "mean"
    if "1_Pooling/config.json" in files:
        modes = [mode for key, mode in _ST_POOLING.items() if json.loads(files["1_Pooling/config.json"]).get(key)]
        if len(modes) != 1:
            raise ValueError("1_Pooling/config.json: exactly one of mean, cls or last-token pooling is supported")
        pooling = modes[0]
    modules = json.loads(files.get("modules.json", b"[]"))
    return pooling, any(m.get("type", "").endswith("Normalize") for m in modules)


def from_hf_files(files: dict[str, bytes]) -> EncoderFiles:
    """A BERT-family folder's files by relative path (config.json, model.safetensors, tokenizer.json, and
    sentence-transformers' 1_Pooling/config.json, modules.json, sentence_bert_config.json where present)."""
    from safetensors.torch import load as load_safetensors
    from tokenizers import Tokenizer

    for need in ("config.json", "model.safetensors", "tokenizer.json"):
        if need not in files:
            raise FileNotFoundError(f"an encoder's folder needs {need}")
    config = EncoderConfig.from_hf(json.loads(files["config.json"]))
    state = load_safetensors(files["model.safetensors"])
    state = {k.removeprefix("bert."): v for k, v in state.items()}
    tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
    tokenizer.no_padding()
    tokenizer.no_truncation()
    pooling, normalize = st_pooling(files)
    st = json.loads(files.get("sentence_bert_config.json", b"{}"))
    return EncoderFiles(config, state, tokenizer, pooling, normalize,
                        min(st.get("max_seq_length", config.max_positions), config.max_positions))


def read_folder(folder: Path) -> dict[str, bytes]:
    names = ("config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json", "modules.json",
             "sentence_bert_config.json")
    return {n: (folder / n).read_bytes() for n in names if (folder / n).is_file()}


# GGUF tensor names (llama.cpp's) -> transformers' (BertModel, NomicBertModel); {i}: the layer
_BERT_NAMES = {
    "token_embd.weight": "embeddings.word_embeddings.weight", "token_types.weight":
    "embeddings.token_type_embeddings.weight", "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight", "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
_BERT_LAYER = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
               "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
               "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
_NOMIC_LAYER = {"attn_output": "self_attn.o_proj", "attn_output_norm": "post_attention_layernorm",
                "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj",
                "layer_output_norm": "post_mlp_layernorm"}


def _hf_name(arch: str, name: str) -> list[str]:
    if name in _BERT_NAMES:
        return [_BERT_NAMES[name]]
    _, layer, part, kind = name.split(".")
    if arch == "nomic-bert":
        if part == "attn_qkv":  # one fused matrix: split into q, k, v below
            return [f"layers.{layer}.self_attn.{p}_proj.{kind}" for p in "qkv"]
        return [f"layers.{layer}.{_NOMIC_LAYER[part]}.{kind}"]
    return [f"encoder.layer.{layer}.{_BERT_LAYER[part]}.{kind}"]


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def from_gguf(path: Path) -> EncoderFiles:
    """A llama.cpp `bert` or `nomic-bert` GGUF: its tensors dequantized to fp32 where they are not already
    (F16 is exact in fp32), its WordPiece vocabulary, its pooling type."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ("bert", "nomic-bert"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not an encoder margingate runs (bert, nomic-bert)")
    key = lambda k: _field(reader, f"{arch}.{k}")  # noqa: E731
    tokens = _field(reader, "tokenizer.ggml.tokens")
    state = {}
    for t in reader.tensors:
        data = t.data if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) \
            else gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape([int(x) for x in reversed(t.shape)])
        names = _hf_name(arch, t.name)
        state.update(zip(names, w.chunk(len(names))))
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    config = EncoderConfig(arch, hidden, key("block_count"), heads, key("feed_forward_length"), len(tokens),
                           key("context_length"), key("attention.layer_norm_epsilon") or 1e-12,
                           key("rope.freq_base") or 1000.0)
    pooling = GGUF_POOLING.get(key("pooling_type") or 1)
    if pooling is None:
        raise ValueError(f"{path}: pooling type {key('pooling_type')} is not one of mean, cls, last")
    return EncoderFiles(config, state, wordpiece(tokens, _field(reader, "tokenizer.ggml.unknown_token_id") or 100),
                        pooling, True, config.max_positions)


def wordpiece(gguf_tokens: list[str], unk: int):
    """BERT's tokenizer from a GGUF vocabulary. llama.cpp's converter writes a word-initial piece as
    "\u2581piece" and a continuation "##piece" as "piece" ([CLS]-style specials as they are): undone here.
    Lower-cased where the vocabulary has no capital letters (an uncased model)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    def piece(t: str) -> str:
        if t.startswith("\u2581"):
            return t[1:]
        return t if t.startswith("[") and t.endswith("]") else "##" + t

    vocab = {piece(t): i for i, t in enumerate(gguf_tokens)}
    uncased = not any(c.isascii() and c.isupper() for t in vocab if not t.startswith("[") for c in t)
    tok = Tokenizer(WordPiece(vocab, unk_token=piece(gguf_tokens[unk]), max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=uncased)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return tok
