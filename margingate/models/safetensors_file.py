"""One safetensors file as memory-mapped tensors, its header checked against the file first.

The header is JSON that says where each tensor lies. A corrupt or hostile one can claim a header
longer than the file, offsets past its end, a shape its bytes do not fill, or a dtype no one reads:
each is refused here with the file, the tensor and the field, before any tensor is viewed, and no
buffer is ever sized from a number the file has not backed.
"""
from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import torch

from .weights import WeightsError

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # the format's own bound on the header (safetensors refuses larger ones too)


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as views of a private (copy-on-write) memory map: pages
    are read from the file when touched and stay reclaimable page cache."""
    with open(path, "rb") as f:
        size, length, header = _header(f, path)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base, out = 8 + length, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = _entry(name, meta, path, size - base)
        flat = torch.frombuffer(mapped, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start) \
            if end > start else torch.empty(0, dtype=dtype)
        out[name] = flat.view(shape)
    return out


def read_metadata(path: Path) -> dict:
    """The file's `__metadata__` ({} if none)."""
    with open(path, "rb") as f:
        meta = _header(f, path)[2].get("__metadata__", {})
    if not isinstance(meta, dict):
        raise WeightsError(f"{path}: the safetensors __metadata__ is not a JSON object")
    return meta


def _header(f, path: Path) -> tuple[int, int, dict]:
    """The open file's size, its header's length and the header, checked against the size."""
    size = f.seek(0, 2)
    f.seek(0)
    length = int.from_bytes(f.read(8), "little") if size >= 8 else -1
    if not 2 <= length <= min(MAX_HEADER, size - 8):
        raise WeightsError(f"{path} ({size:,} bytes) is not a safetensors file: its header length "
                           f"field says {length:,} bytes")
    return size, length, _parse(f.read(length), path)


def _parse(raw: bytes, path: Path) -> dict:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WeightsError(f"{path}: the safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: the safetensors header is not a JSON object")
    return header


def _entry(name: str, meta, path: Path, data_bytes: int) -> tuple[torch.dtype, list[int], tuple[int, int]]:
    """A tensor's dtype, shape and byte range, each checked against the file's data section."""
    def bad(what: str) -> WeightsError:
        return WeightsError(f"{name} in {path}: {what}")

    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= meta.keys():
        raise bad("its header entry needs dtype, shape and data_offsets")
    dtype = DTYPES.get(meta["dtype"]) if isinstance(meta["dtype"], str) else None
    if dtype is None:
        raise bad(f"dtype {meta['dtype']!r}, which margingate does not read")
    shape, offsets = meta["shape"], meta["data_offsets"]
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise bad(f"shape {shape!r} is not a list of integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
            or not offsets[0] <= offsets[1] <= data_bytes:
        raise bad(f"data_offsets {offsets!r} do not lie within the file's {data_bytes:,} data bytes")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise bad(f"shape {shape} of {meta['dtype']} needs {math.prod(shape) * dtype.itemsize:,} bytes, "
                  f"data_offsets give {offsets[1] - offsets[0]:,}")
    return dtype, shape, (offsets[0], offsets[1])


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
