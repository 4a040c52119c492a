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
import os
from collections.abc import Collection
from pathlib import Path

import torch

from .weights import WeightsError

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # the format's own bound on the header (safetensors refuses larger ones too)
ALIGN, HUGE_PAGE = 64, 2 << 20


def mmap_safetensors(path: Path, private: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file as views of a private (copy-on-write) memory map: pages
    are read from the file when touched and stay reclaimable page cache. The tensors named in `private` are
    read instead into this process's own memory, one anonymous buffer in which huge pages are asked for
    (weights_memory.py says when and why)."""
    with open(path, "rb") as f:
        size, length, header = _header(f, path)
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        base = 8 + length
        entries = {name: _entry(name, meta, path, size - base) for name, meta in header.items()
                   if name != "__metadata__"}
        own = _read_private(f, path, base, {n: e[2] for n, e in entries.items() if n in private and e[2][1] > e[2][0]})
    out = {}
    for name, (dtype, shape, (start, end)) in entries.items():
        if name in own:
            flat = own[name].view(dtype)
        else:
            flat = torch.frombuffer(mapped, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start) \
                if end > start else torch.empty(0, dtype=dtype)
        out[name] = flat.view(shape)
    return out


def _read_private(f, path: Path, base: int, spans: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """The byte ranges `spans` of the open file, read into one private anonymous buffer (2 MiB aligned, huge
    pages asked for), each at a 64-byte boundary of it: {name: uint8 tensor}."""
    if not spans:
        return {}
    at, total = {}, 0
    for name, (start, end) in spans.items():
        at[name], total = total, total + -(-(end - start) // ALIGN) * ALIGN
    buf = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # holds the buffer for as long as any view of it lives
    skip, view, out = -whole.data_ptr() % HUGE_PAGE, memoryview(buf), {}
    for name, (start, end) in spans.items():
        lo = skip + at[name]
        done = 0
        while done < end - start:  # a read returns at most about 2 GiB
            got = os.preadv(f.fileno(), [view[lo + done: lo + end - start]], base + start + done)
            if got <= 0:
                raise WeightsError(f"{path}: {name}'s bytes end early (the file changed while it was read)")
            done += got
        out[name] = whole[lo: lo + end - start]
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
