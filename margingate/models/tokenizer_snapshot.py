"""What transformers makes of a model folder's tokenizer, kept in the cache: later starts load it with the
`tokenizers` library alone, without importing transformers (about 2 s) or running AutoTokenizer (about 1 s).

The first load of a folder builds its tokenizer with transformers' `AutoTokenizer`, as every load did before,
and keeps two files under `tokenizers/<key>/` in the cache:
- `tokenizer.json`: the Rust tokenizer transformers built, serialized by the `tokenizers` library itself, with
  no padding and no truncation (as transformers encodes without them). It is not always the folder's own
  tokenizer.json: transformers 5 rebuilds some tokenizers from their class (Qwen2's adds an NFC normalizer the
  file does not name), so the snapshot is taken from what it built, never from the file.
- `meta.json`: what transformers adds around it: the chat template, the special tokens a template sees, the
  end-of-sequence id, whether decoding cleans up spaces (transformers does it for non-BPE models only) and
  whether special tokens are split when encoding.

The key: every file of the folder but its weights (names and bytes), the installed transformers (the size and
mtime of its `__init__.py`: an upgrade may build another tokenizer) and SNAPSHOT_VERSION. A GGUF's conversion
(`gguf_import.save_tokenizer`) takes the snapshot as it writes the folder where a load of the folder would build
the same tokenizer (`same_on_reload`), so its first start builds no second tokenizer.
`tests/test_tokenizer_backend.py` checks ids, texts and chat prompts against transformers'.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from ..paths import cache_root

SNAPSHOT_VERSION = 1
WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".npz")  # not part of a tokenizer


def key(folder: Path) -> str:
    h = hashlib.sha256(f"{SNAPSHOT_VERSION}\0".encode())
    spec = importlib.util.find_spec("transformers")  # found, not imported
    if spec is not None and spec.origin:
        st = os.stat(spec.origin)
        h.update(f"{spec.origin} {st.st_size} {st.st_mtime_ns}\0".encode())
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHTS):
            h.update(f"{f.name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:20]


def snapshot(folder: Path) -> tuple[Path, dict]:
    """The tokenizer.json to load and the meta of `folder`'s tokenizer, taken through transformers when the
    cache has none for its key."""
    where = cache_root() / "tokenizers" / key(folder)
    if not (where / "meta.json").exists():
        take(_transformers_tokenizer(folder), where, handed_over=True)
    return where / "tokenizer.json", json.loads((where / "meta.json").read_text(encoding="utf-8"))


# The Rust tokenizer this process last saved as a snapshot, where its taker used it no more (a conversion's, a
# first load's), by the file it was saved to: the load that follows at a first start takes it from here rather
# than parsing back the file just written (a second for 262k tokens). One slot: any later take or load empties it.
_HANDED: dict[Path, object] = {}


def load(path: Path):
    """The Rust tokenizer of the snapshot file `path`: the very object saved there by this process, where it was
    handed over (`_HANDED`), else read from the file. Either is the state that file serializes."""
    handed = _HANDED.pop(path, None)
    _HANDED.clear()
    if handed is not None:
        return handed
    from tokenizers import Tokenizer as Backend

    return Backend.from_file(str(path))


# transformers' tokenizer classes whose `__init__` rebuilds the Rust tokenizer, and rebuilds from a saved folder
# exactly what it built for the GGUF conversion: GemmaTokenizer builds a BPE of the vocabulary and merges it is
# handed and fixed normalizer, pre-tokenizer and decoder; the conversion (transformers' gemma_tokenizer) ran that
# same `__init__` on the same vocabulary and merges, and a load of the folder hands it them back as saved.
# tests/test_tokenizer_rebuild.py proves each one (snapshot bytes, meta, ids and texts against a reload); Qwen2's
# class is not one of them: it adds an NFC normalizer the conversion's tokenizer lacks.
SAME_ON_RELOAD = frozenset({"transformers.models.gemma.tokenization_gemma.GemmaTokenizer"})


def same_on_reload(hf_tokenizer) -> bool:
    """Does a load of the folder `hf_tokenizer` was saved to build this very tokenizer? True for a class that
    loads its tokenizer.json as it is (transformers' own test: TokenizersBackend, or no `__init__` of its own) and
    for the classes of SAME_ON_RELOAD."""
    from transformers import TokenizersBackend

    cls = type(hf_tokenizer)
    return (cls is TokenizersBackend or "__init__" not in cls.__dict__
            or f"{cls.__module__}.{cls.__qualname__}" in SAME_ON_RELOAD)


def take_for(folder: Path, hf_tokenizer) -> None:
    """Keep `hf_tokenizer`, transformers' tokenizer just saved to `folder` by its save_pretrained and used no more
    by the caller, as the folder's snapshot. save_pretrained wrote the Rust tokenizer's own serialization as the
    folder's tokenizer.json: where the snapshot's would be the same (no padding, no truncation), it is copied."""
    take(hf_tokenizer, cache_root() / "tokenizers" / key(folder), handed_over=True, saved=folder / "tokenizer.json")


def take(hf_tokenizer, where: Path, handed_over: bool = False, saved: Path | None = None) -> None:
    """Write the snapshot of a transformers tokenizer into the folder `where` (whole or not at all: a temporary
    folder renamed into place; a process that lost the race to write the same key keeps the winner's).
    `handed_over`: the caller uses `hf_tokenizer` no more, so the next `load` may take its Rust tokenizer;
    `saved`: a file this Rust tokenizer was saved to as it is (take_for)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise FileNotFoundError(f"{type(hf_tokenizer).__name__} is not a fast (Rust) tokenizer; margingate loads "
                                "tokenizers through the `tokenizers` library")
    if backend.padding is not None or backend.truncation is not None:  # a copy: the caller's keeps its settings
        backend = backend.__class__.from_str(backend.to_str())  # (a second for 262k tokens: only when needed)
        backend.no_padding()
        backend.no_truncation()
        saved = None
    bpe = type(backend.model).__name__ == "BPE"
    forced = getattr(hf_tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    meta = {"chat_template": hf_tokenizer.chat_template, "special_tokens": dict(hf_tokenizer.special_tokens_map),
            "eos_token_id": hf_tokenizer.eos_token_id,
            "clean_up": bool(hf_tokenizer.clean_up_tokenization_spaces) and (not bpe or bool(forced)),
            "split_special_tokens": bool(getattr(hf_tokenizer, "split_special_tokens", False))}
    tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    _HANDED.clear()
    try:
        if saved is not None:
            shutil.copyfile(saved, tmp / "tokenizer.json")
        else:
            backend.save(str(tmp / "tokenizer.json"))
        (tmp / "meta.json").write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, where)
        if handed_over:
            _HANDED[where / "tokenizer.json"] = backend
    except OSError:
        if not (where / "meta.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _transformers_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - any failure here means the folder lacks a usable tokenizer
        raise FileNotFoundError(f"no usable tokenizer in {folder}: {exc}") from exc
