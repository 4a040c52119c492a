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
(`gguf_import.save_tokenizer`) takes the snapshot as it writes the folder, so its first start builds no second
tokenizer. `tests/test_tokenizer_backend.py` checks ids, texts and chat prompts against transformers'.
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
        take(_transformers_tokenizer(folder), where)
    return where / "tokenizer.json", json.loads((where / "meta.json").read_text(encoding="utf-8"))


def take_for(folder: Path, hf_tokenizer) -> None:
    """Keep `hf_tokenizer`, transformers' tokenizer loaded from `folder` as it is now, as the folder's snapshot."""
    take(hf_tokenizer, cache_root() / "tokenizers" / key(folder))


def take(hf_tokenizer, where: Path) -> None:
    """Write the snapshot of a transformers tokenizer into the folder `where` (whole or not at all: a temporary
    folder renamed into place; a process that lost the race to write the same key keeps the winner's)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise FileNotFoundError(f"{type(hf_tokenizer).__name__} is not a fast (Rust) tokenizer; margingate loads "
                                "tokenizers through the `tokenizers` library")
    backend = backend.__class__.from_str(backend.to_str())  # a copy: the caller's keeps its settings
    backend.no_padding()
    backend.no_truncation()
    bpe = type(backend.model).__name__ == "BPE"
    forced = getattr(hf_tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    meta = {"chat_template": hf_tokenizer.chat_template, "special_tokens": dict(hf_tokenizer.special_tokens_map),
            "eos_token_id": hf_tokenizer.eos_token_id,
            "clean_up": bool(hf_tokenizer.clean_up_tokenization_spaces) and (not bpe or bool(forced)),
            "split_special_tokens": bool(getattr(hf_tokenizer, "split_special_tokens", False))}
    tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        backend.save(str(tmp / "tokenizer.json"))
        (tmp / "meta.json").write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, where)
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
