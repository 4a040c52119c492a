"""A GGUF's tensors found in its tensor table, read without the `gguf` package where that is not needed.

`tensor_tables` walks each part's header (gguf_header.tensor_table: every field checked against the file) and
names the GGML types it finds; `RawTensor` is one tensor as gguf's reader presents one (name, tensor_type,
shape, data). A packed-cache hit (packed_cache.py) keeps the tables beside the packed matrices, so a later start
neither walks the header again nor imports `gguf` (0.5 s): its few plain tensors (norms, biases: F32, F16 or BF16)
are read here; any other type is dequantized by gguf itself.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .gguf_names import GGUFError

PLAIN = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # types read without gguf


class GGMLType(NamedTuple):
    """A GGML tensor type as gguf's constants name and size it."""
    id: int
    name: str
    block: int        # elements per block
    block_bytes: int


class TensorTables(NamedTuple):
    """Each part's tensor table, (name, GGUF dims, type id, first byte, bytes) per tensor, and its types."""
    parts: list[list[tuple]]
    types: dict[int, GGMLType]

    def to_json(self) -> dict:
        return {"parts": self.parts, "types": {str(k): list(t) for k, t in self.types.items()}}

    @classmethod
    def from_json(cls, raw: dict) -> TensorTables:
        return cls([[tuple(e) for e in part] for part in raw["parts"]],
                   {int(k): GGMLType(*t) for k, t in raw["types"].items()})


def ggml_types() -> dict[int, GGMLType]:
    import gguf

    return {int(k): GGMLType(int(k), k.name, *s) for k, s in gguf.GGML_QUANT_SIZES.items()}


class Header(NamedTuple):
    """One part's header: its metadata (every key, the vocabulary's too) and its tensors."""
    meta: dict
    tensors: list[RawTensor]


# The tensor tables this process has walked, by file (path, size, mtime): a first start converts the file (its
# header walked for the metadata) and then loads its tensors, and a second walk of a 262k-token vocabulary costs
# a second or two. Only the tables are kept (a few hundred tuples), not the metadata with its vocabulary.
_WALKED: dict[tuple, TensorTables] = {}


def _file_key(paths: list[Path]) -> tuple:
    return tuple((str(Path(p).resolve()), s.st_size, s.st_mtime_ns) for p, s in ((p, Path(p).stat()) for p in paths))


def read_headers(paths: list[Path]) -> tuple[list[Header], TensorTables]:
    """Each part's header, walked and checked (gguf_header.read_header), and the parts' tensor tables."""
    from .gguf_header import read_header

    types = ggml_types()
    sizes = {k: (t.block, t.block_bytes) for k, t in types.items()}
    read = [_checked(read_header, p, sizes) for p in paths]
    tables = TensorTables([table for _, table in read], {e[2]: types[e[2]] for _, table in read for e in table})
    _WALKED[_file_key(paths)] = tables
    return [Header(meta, [RawTensor(p, e, tables.types) for e in table])
            for p, (meta, table) in zip(paths, read)], tables


def _checked(read, path: Path, sizes: dict):
    try:
        return read(path, sizes)
    except (ValueError, IndexError, OSError) as exc:
        raise GGUFError(f"{path} ({path.stat().st_size:,} bytes) is not a complete GGUF file: {exc}. "
                        "It is truncated (an interrupted download, or not all of its parts) or corrupt") from exc


def tensor_tables(paths: list[Path]) -> TensorTables:
    """Each part's tensor table, its header walked and checked (once per file and process), and the types it names."""
    walked = _WALKED.get(_file_key(paths))
    return walked if walked is not None else read_headers(paths)[1]


class RawTensor:
    """A GGUF tensor as gguf's reader presents one (name, tensor_type, shape, data), found in the file's
    tensor table: no reader, which decodes every metadata value first (seconds per load). `data` is
    read from the file each time it is asked for, not mapped: a mapping would keep every page of the
    file resident beside the repacked model until the last tensor is built."""

    def __init__(self, path: Path, entry: tuple, types: dict[int, GGMLType]):
        self.name, dims, kind, self.start, self.nbytes = entry
        self.path, self.tensor_type, self.shape = path, types[kind], list(dims)
        self.rows = (*reversed(dims[1:]), dims[0] // self.tensor_type.block * self.tensor_type.block_bytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def data(self) -> np.ndarray:
        return np.fromfile(self.path, dtype=np.uint8, count=self.nbytes, offset=self.start).reshape(self.rows)

    def row_range(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a matrix ([stop - start, row bytes] uint8), read from the file alone."""
        width = self.rows[-1]
        return np.fromfile(self.path, dtype=np.uint8, count=(stop - start) * width,
                           offset=self.start + start * width).reshape(stop - start, width)

    def expert(self, e: int) -> RawTensor:
        """Expert e's matrix of a stacked [experts, rows, k] tensor (GGUF shape [k, rows, experts]), or its bias
        of a stacked [experts, rows] one (gpt-oss)."""
        part = copy.copy(self)
        part.nbytes = self.nbytes // self.shape[-1]
        part.start, part.shape, part.rows = self.start + e * part.nbytes, self.shape[:-1], self.rows[1:]
        return part

    def dequantized(self) -> np.ndarray:
        """fp32 values, as `gguf.quants.dequantize` gives them (the plain types read here by the same rule)."""
        kind = self.tensor_type.name
        if kind == "F32":
            return self.data.view(np.float32).copy()
        if kind == "F16":
            return self.data.view(np.float16).astype(np.float32)
        if kind == "BF16":
            return (self.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        import gguf

        return gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType(self.tensor_type.id)).copy()
