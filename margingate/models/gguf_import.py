"""A GGUF model (one file or the parts of a split one) -> a Hugging Face style folder.

config.json and the tokenizer (with its chat template) from the GGUF metadata; where a load needs
them, the tensors dequantized once to BF16 (any type `gguf.quants.dequantize` knows) as safetensors
shards, so that load is the plain folder path. `load_quantized` reads the GGUF's tensors directly.
llama.cpp's conventions are undone here: Llama-arch files store Q/K rows interleaved for its RoPE,
Gemma files store norm weights as 1 + w.
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from . import gguf_merges, tokenizer_snapshot
from .gguf_names import ARCHS, ROPE_FREQS, GGUFError, arch_of, architecture_key, expert_names, hf_name, unpermute
from .gguf_tensors import Header, RawTensor, TensorTables, read_headers, tensor_tables

__all__ = ["GGUFError", "convert", "load_quantized", "hf_name", "unpermute", "readers", "architecture"]

# Bump when a conversion's output changes: folders converted by an older version are converted again.
# 2: no built-in chat template for a GGUF that carries none (a base model). 3: mixtures of experts.
IMPORT_VERSION = 3
SHARD_BYTES = 2 << 30  # safetensors shard size: bounds the conversion's memory, not the model's


def readers(paths: list[Path]) -> list[Header]:
    """Each part's header (gguf_tensors.Header: metadata and tensors), every count, length, type, shape and
    offset checked against the file; GGUFError names a file that cannot back them."""
    return read_headers(paths)[0]


def metadata(reader: Header) -> dict:
    return {k: v for k, v in reader.meta.items()
            if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                         "tokenizer.ggml.token_type")}


def architecture(meta: dict, source: Path) -> str:
    """Our ARCHS key for the file (gguf_names.architecture_key), or GGUFError naming its architecture."""
    arch = architecture_key(meta)
    if arch is None:
        raise GGUFError(f"{source}: GGUF architecture {meta.get('general.architecture')!r} is not supported "
                        f"(supported: {', '.join(ARCHS)}; mixtral is llama with experts)")
    return arch


def bf16_bytes(parts) -> int:
    """The model's size once dequantized to BF16 (2 bytes per weight), from its parts' readers."""
    return sum(2 * int(t.n_elements) for r in parts for t in r.tensors)


def convert(paths: list[Path], folder: Path, tensors: bool = True, metadata_too: bool = True,
            fits: Callable[[int], None] | None = None) -> None:
    """Write the HF-style folder for the GGUF file `paths` (a split file's parts, in order): config.json
    and the tokenizer, and with `tensors` the weights dequantized to bf16 safetensors. A model whose
    GGUF is read directly (`load_quantized`) needs only the first two: seconds, not a bf16 copy.
    metadata_too False: add the tensors to a folder whose config and tokenizer are current. `fits`
    gets the bf16 bytes before any tensor is written (it raises where they do not fit)."""
    parts = readers(paths)  # once: reading a vocabulary of 10^5 tokens from the header takes seconds
    if tensors and fits:
        fits(bf16_bytes(parts))
    meta = metadata(parts[0])
    arch = architecture(meta, paths[0])
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for old in tmp.glob("*.safetensors"):  # an interrupted earlier conversion
        old.unlink()
    if tensors:
        _write_tensors(paths, arch, meta, tmp)
    if metadata_too:
        names = {hf_name(t.name, arch) for r in parts for t in r.tensors if t.name != ROPE_FREQS}
        config = hf_config(meta, parts[0], arch, tied="lm_head.weight" not in names)
        (tmp / "config.json").write_text(json.dumps({**config, "source_gguf": paths[0].name,
                                                     "margingate_import_version": IMPORT_VERSION}, indent=2))
        save_tokenizer(paths[0], tmp, parts[0])
    if folder.exists() and not metadata_too:
        for f in tmp.iterdir():
            f.replace(folder / f.name)
        tmp.rmdir()
    elif folder.exists():  # an older conversion: its files give way, none of them stays behind
        fresh = {f.name for f in tmp.iterdir()}
        for f in folder.iterdir():
            if f.name not in fresh and f.is_file():
                f.unlink()
        for f in tmp.iterdir():
            f.replace(folder / f.name)
        tmp.rmdir()
    else:
        tmp.replace(folder)


def _write_tensors(paths: list[Path], arch: str, meta: dict, out: Path) -> None:
    """Every tensor dequantized to bf16 (each expert of a stacked tensor apart), in safetensors shards
    of about SHARD_BYTES."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    prefix = ARCHS[arch].meta
    n_heads, n_kv = meta[f"{prefix}.attention.head_count"], meta[f"{prefix}.attention.head_count_kv"]
    tensors = list(hf_tensors(paths, arch, int(meta.get(f"{prefix}.expert_count", 0) or 0)))
    shard, size, shards = {}, 0, 0
    for name, t in tqdm(tensors, desc=f"dequantizing {paths[0].name} to bf16", unit="tensor"):
        w = bf16_tensor(t, arch, n_heads, n_kv)
        shard[name] = w
        size += 2 * w.numel()
        if size >= SHARD_BYTES:
            shards += 1
            save_file(shard, str(out / f"model-{shards:05d}.safetensors"))
            shard, size = {}, 0
    if shard:
        save_file(shard, str(out / (f"model-{shards + 1:05d}.safetensors" if shards else "model.safetensors")))


def bf16_tensor(t: RawTensor, arch: str, n_heads: int, n_kv: int) -> torch.Tensor:
    """One GGUF tensor dequantized to bf16, llama.cpp's conventions undone (Q/K rows, Gemma's norms)."""
    w = torch.from_numpy(t.dequantized())
    if ARCHS[arch].permuted and ".attn_q." in t.name:
        w = unpermute(w, n_heads)
    elif ARCHS[arch].permuted and ".attn_k." in t.name:
        w = unpermute(w, n_kv)
    if arch == "gemma3" and t.name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp folds Gemma's (1 + w) into the stored weight
    return w.to(torch.bfloat16).contiguous()


def hf_tensors(paths: list[Path], arch: str, experts: int, tables: TensorTables | None = None):
    """(Hugging Face name, RawTensor) for every weight of the file, in its order; a stacked experts'
    tensor gives one matrix per expert. The rope_freqs tensor is config (`convert` reads it there).
    `tables`: the parts' tensor tables as an earlier load found them (packed_cache.py); None walks the headers."""
    tables = tables or tensor_tables(paths)
    for path, table in zip(paths, tables.parts):
        for entry in table:
            t = RawTensor(path, entry, tables.types)
            if t.name == ROPE_FREQS:
                continue
            names = expert_names(hf_name(t.name, arch), experts)
            stacked = len(t.shape) == (2 if t.name.endswith(".bias") else 3)
            if stacked != (len(names) > 1) or (stacked and t.shape[-1] != experts):
                raise GGUFError(f"{path}: {t.name} has shape {t.shape}, which a {arch} model with {experts} "
                                "experts does not have")
            yield from ((n, t.expert(e) if stacked else t) for e, n in enumerate(names))


def load_quantized(paths: list[Path], config: dict, tables: TensorTables | None = None) -> dict:
    """The GGUF's tensors by Hugging Face name, straight from the file: each matrix of a type
    gguf_quant keeps quantized as a GGUFMatrix (read when the model is built), every other tensor
    dequantized to bf16 exactly as `convert` writes it. `config`: the converted folder's config.json
    (architecture, heads and experts); `tables`: as hf_tensors takes them."""
    from .gguf_quant import TYPES, GGUFMatrix

    arch = arch_of(config["model_type"])
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    heads = {".attn_q.": n_heads, ".attn_k.": n_kv} if ARCHS[arch].permuted else {}
    experts = config.get("num_experts", config.get("num_local_experts", 0))
    state = {}
    for name, t in hf_tensors(paths, arch, experts, tables):
        if t.tensor_type.name in TYPES and len(t.shape) == 2:
            state[name] = GGUFMatrix(t, next((h for k, h in heads.items() if k in t.name), None))
        else:
            state[name] = bf16_tensor(t, arch, n_heads, n_kv)
    return state


def hf_config(meta: dict, reader, arch: str, tied: bool) -> dict:
    """config.json for the model, from the GGUF metadata (as transformers would read it)."""
    spec = ARCHS[arch]

    def get(key, default=None):
        return meta.get(f"{spec.meta}.{key}", default)

    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = {
        "architectures": [spec.hf], "model_type": spec.model_type,
        "vocab_size": int(get("vocab_size", embed.shape[-1])),  # GGUF shapes are reversed: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", get("expert_feed_forward_length", 0))),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads, "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": end_tokens(meta, reader),
        "torch_dtype": "bfloat16",
    }
    if get("attention.sliding_window") is not None:
        config["sliding_window"] = int(get("attention.sliding_window"))
    config.update(rope_config(get, reader), **moe_config(get, arch))
    if arch == "gemma3":  # what llama.cpp fixes for Gemma 3 rather than storing
        config.update(rope_local_base_freq=10000.0, sliding_window_pattern=6,
                      query_pre_attn_scalar=config["head_dim"], hidden_activation="gelu_pytorch_tanh")
    if arch == "gpt-oss":  # its YaRN is stated whole in rope_parameters
        config.pop("rope_scaling", None)
        config.update(gpt_oss_config(get, config))
    return config


def gpt_oss_config(get, config: dict) -> dict:
    """What llama.cpp fixes for gpt-oss rather than storing: every other layer sliding (the first one), YaRN's
    betas 32 and 1 on the original config's untruncated ramp, the clamped SwiGLU's 1.702 and 7.0, biases."""
    n = config["num_hidden_layers"]
    rope = {"rope_type": "yarn", "rope_theta": config["rope_theta"], "factor": float(get("rope.scaling.factor", 32.0)),
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 4096))}
    return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
            "rope_parameters": rope, "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
            "intermediate_size": int(get("expert_feed_forward_length")),
            "num_local_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count"))}


def moe_config(get, arch: str) -> dict:
    """A mixture of experts' shape. llama.cpp's qwen3moe and llama (Mixtral) graphs renormalize the kept
    weights whatever the source config said, so a file of theirs means norm_topk_prob true."""
    if arch == "qwen3moe":
        return {"num_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count")),
                "moe_intermediate_size": int(get("expert_feed_forward_length")), "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "mixtral":
        return {"num_local_experts": int(get("expert_count")), "num_experts_per_tok": int(get("expert_used_count"))}
    return {}


def rope_config(get, reader) -> dict:
    """RoPE scaling as config.json states it: a `rope_freqs` tensor as its factors; linear scaling from
    the metadata; any other scaling type under its own name, which the config reader refuses."""
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        return {"rope_freq_factors": [float(v) for v in np.asarray(freqs.dequantized(), dtype=np.float32).reshape(-1)]}
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    return {"rope_scaling": {"rope_type": str(kind), "factor": float(get("rope.scaling.factor", 1.0))}}


def end_tokens(meta: dict, reader) -> int | list[int]:
    """The end-of-sequence id, and the end-of-turn ids a chat model stops at when the GGUF names them."""
    ids = [int(meta["tokenizer.ggml.eos_token_id"])] if "tokenizer.ggml.eos_token_id" in meta else []
    ids += [int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
    if meta.get("general.architecture") == "gemma3":  # its chat turns end with <end_of_turn>
        tokens = reader.meta["tokenizer.ggml.tokens"]
        ids += [tokens.index("<end_of_turn>")] if "<end_of_turn>" in tokens else []
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else ids


def save_tokenizer(gguf_path: Path, out: Path, reader: Header) -> None:
    """transformers' tokenizer from the GGUF metadata (vocabulary, merges, chat template); `reader`:
    the file's header, already read. Where a load of the saved folder builds this same tokenizer
    (tokenizer_snapshot.same_on_reload: a class that loads tokenizer.json as it is, or one proven to rebuild it
    the same, as Gemma's), the folder's snapshot is taken from this tokenizer now, not from a second build of
    262k tokens; the others (Qwen2's class adds a normalizer) load the folder at first use."""
    with _gpt_oss_rope_keys_hidden(reader.meta), metadata_already_read(gguf_path, reader), gguf_merges.derived_fast():
        tok = gguf_tokenizer(gguf_path, reader.meta)
    if not getattr(tok, "chat_template", None):  # transformers reads it for some architectures only
        template = reader.meta.get("tokenizer.chat_template")
        if template is not None:  # none: a base model, prompted as text (tokenizer.py)
            tok.chat_template = template
    tok.save_pretrained(str(out))
    if tokenizer_snapshot.same_on_reload(tok):
        tokenizer_snapshot.take_for(out, tok)


# GGUF architectures whose tokenizer class transformers' AutoTokenizer picks from the model type alone (what it
# names the type: gemma3's is gemma3_text), when no tokenizer or config file lies beside the GGUF.
BY_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}


def gguf_tokenizer(gguf_path: Path, meta: dict):
    """transformers' AutoTokenizer of a GGUF file. AutoTokenizer first reads the whole file with gguf's reader
    to learn the model type (a minute for a 262k vocabulary: a numpy view per string) and then has the type's
    tokenizer class read the tokenizer with transformers' own fast reader; here the type comes from the header
    we read already, and the class is the one AutoTokenizer maps it to. Where its choice depends on more (a
    tokenizer_config.json or config.json beside the file, a Mistral name, another architecture), AutoTokenizer."""
    from transformers import AutoConfig, AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    arch = meta.get("general.architecture")
    beside = any((gguf_path.parent / f).exists() for f in ("tokenizer_config.json", "config.json", "tokenizer.json"))
    if arch not in BY_TYPE or beside or "mistral" in str(meta.get("general.name", "")).lower():
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    cls = TOKENIZER_MAPPING.get(type(AutoConfig.for_model(BY_TYPE[arch])), TokenizersBackend)
    return cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def transformers_view(meta: dict, string_arrays=()) -> dict:
    """Our walk's metadata as transformers' GGUF reader (`read_gguf_metadata`) gives it: a string array it was not
    asked for in full is its length. (An empty string array, which our walk cannot tell from an empty number
    array, stays a list; no tokenizer key is one.)"""
    return {k: len(v) if isinstance(v, list) and v and isinstance(v[0], str) and k not in string_arrays else v
            for k, v in meta.items()}


@contextlib.contextmanager
def metadata_already_read(gguf_path: Path, header: Header):
    """While transformers builds this file's tokenizer, its GGUF reader returns what our walk already read
    (`transformers_view`) instead of walking the header a second time (a second or more for a 262k-token
    vocabulary); any other file goes to the real reader. tests/test_gguf_metadata_view.py holds the two equal."""
    from transformers.integrations.gguf import reader as hf_reader

    real, target = hf_reader.read_gguf_metadata, Path(gguf_path).resolve()
    names = tuple(t.name for t in header.tensors)

    def read(path, string_arrays=()):
        if Path(path).resolve() != target:
            return real(path, string_arrays)
        return transformers_view(header.meta, string_arrays), names

    hf_reader.read_gguf_metadata = read
    try:
        yield
    finally:
        hf_reader.read_gguf_metadata = real


@contextlib.contextmanager
def _gpt_oss_rope_keys_hidden(meta: dict):
    """transformers 5.24 reads a gpt-oss GGUF's `gpt-oss.rope.scaling.*` values from the wrong part of the field
    (its key's length) and fails; the tokenizer needs none of them, so while it reads the file its reader does
    not see them. Every other file is read as it is."""
    if "gpt-oss.rope.scaling.factor" not in meta:
        yield
        return
    import gguf

    real = gguf.GGUFReader

    class Reader(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for key in [k for k in self.fields if k.startswith("gpt-oss.rope.scaling.")]:
                del self.fields[key]
    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = real
