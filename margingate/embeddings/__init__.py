"""Embeddings: one vector per text, batch-invariant (docs/serving.md, "Embeddings").

    from margingate.embeddings import load
    vectors = load("all-minilm-l6-v2").embed(["a text", "another"]).vectors   # [2, 384] fp32, L2-normed

Encoder models (BERT family: all-MiniLM-L6-v2, nomic-embed-text-v1.5, a Hugging Face BERT folder, a llama.cpp
`bert` / `nomic-bert` GGUF) load here (`load`); a decoder the engine runs embeds through `DecoderEmbedder`
over its loaded model (the command line and the server build it beside the chat model). The parts:
sources.py (models by name, found where pip put them), files.py (an encoder's files), encoder.py (its
forward), embedder.py (pooling, the finish, validation). Loading torch waits for `load`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from . import sources

if TYPE_CHECKING:
    import torch

    from .embedder import Embedder

__all__ = ["decoder_pooling", "files_of", "is_embedding_model", "load"]
ENCODER_TYPES = ("bert", "nomic_bert")
MATRYOSHKA = ("nomic-embed-text-v1.5",)  # trained for truncation (its model card's `dimensions` recipe)


def _gguf_arch(path: Path) -> str | None:
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.architecture")
    return field.contents() if field is not None else None


def is_embedding_model(model: str) -> bool:
    """A named embedding model, an encoder's folder (model_type bert or nomic_bert) or an encoder's GGUF."""
    if sources.is_named(model):
        return True
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()).get("model_type") in ENCODER_TYPES
    return path.is_file() and path.suffix == ".gguf" and _gguf_arch(path) in ("bert", "nomic-bert")


def files_of(model: str):
    """The encoder's files (`files.EncoderFiles`) of `model`: by name (found where pip put them), an encoder's
    Hugging Face folder or a `bert` / `nomic-bert` GGUF."""
    from .files import from_gguf, from_hf_files, read_folder
    from .sources import ModelNotFoundError, extracted_file, minilm_zip, read_zip_folder

    path = Path(model).expanduser()
    if sources.is_named(model):
        if sources.NAMED[model].entry is not None:
            return from_gguf(extracted_file(model))
        with minilm_zip(model) as archive:
            return from_hf_files(read_zip_folder(archive))
    if path.is_dir():
        return from_hf_files(read_folder(path))
    if path.is_file() and path.suffix == ".gguf":
        return from_gguf(path)
    raise ModelNotFoundError(f"embedding model {model!r} is neither a named one ({', '.join(sources.NAMED)}) nor "
                             f"an encoder's folder or GGUF file")


def load(model: str, dtype: torch.dtype | None = None) -> Embedder:
    """The embedder of `model` (`is_embedding_model`), its activations in `dtype` (default fp32)."""
    import torch

    from .embedder import EncoderEmbedder
    from .encoder import EncoderModel

    files = files_of(model)
    name = model if sources.is_named(model) else Path(model).name
    return EncoderEmbedder(name, EncoderModel(files.config, files.state), files.tokenizer, pooling=files.pooling,
                           normalize=files.normalize, max_tokens=files.max_tokens,
                           matryoshka=name.removesuffix(".gguf").removesuffix(".f16") in MATRYOSHKA,
                           dtype=dtype or torch.float32)


def decoder_pooling(folder: Path, gguf_parts: list[Path] | None) -> str:
    """How a decoder's embedding pools, as its files say: sentence-transformers' 1_Pooling/config.json in its
    folder, else its GGUF's `{arch}.pooling_type`; neither: `last` (in a causal model only the last token
    has read the whole text)."""
    from .files import GGUF_POOLING, st_pooling

    if (folder / "1_Pooling" / "config.json").is_file():
        return st_pooling({"1_Pooling/config.json": (folder / "1_Pooling" / "config.json").read_bytes()})[0]
    if gguf_parts:
        import gguf

        reader = gguf.GGUFReader(str(gguf_parts[0]))
        arch = reader.fields["general.architecture"].contents()
        field = reader.fields.get(f"{arch}.pooling_type")
        if field is not None and field.contents() in GGUF_POOLING:
            return GGUF_POOLING[field.contents()]
    return "last"
