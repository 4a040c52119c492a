"""A GGUF file's header, checked against the file before anything trusts it.

gguf's reader takes the header's counts, lengths, dimensions and offsets as they are: a corrupt or
hostile file can make it loop over a count of 2^63, map arrays past the end, or describe a tensor
that the file does not hold. `check_header` walks the header first (the layout of GGUF v2 and v3,
little-endian) over a memory map, allocating nothing that the header sizes, and raises `HeaderError`
at the first field the file cannot back: a count larger than the bytes left could hold, a string
or array running past the end, an unknown value or tensor type, a shape of no or too many
dimensions, or tensor data outside the file. What it lets through, the reader can read.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

MAX_DIMS = 4                 # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 48       # per tensor: far past any model, far below overflow
MAX_DEPTH = 2                # arrays of arrays (GGUF allows them; no model nests deeper)
DEFAULT_ALIGNMENT = 32
# value type -> its size in bytes (STRING = 8 and ARRAY = 9 have their own layout)
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MIN_KV, MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8  # the least bytes one entry can take
_U64 = struct.Struct("<Q")


class HeaderError(ValueError):
    """A header field that the file cannot back (the message names it and where it is)."""


class _Cursor:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.at = buf, size, 0

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.at + n > self.size:
            raise HeaderError(f"the header ends inside {what} (byte {self.at:,} of {self.size:,})")
        value = struct.unpack_from(fmt, self.buf, self.at)
        self.at += n
        return value[0] if len(value) == 1 else value

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise HeaderError(f"{what} of {n:,} bytes runs past the end of the file "
                              f"(byte {self.at:,} of {self.size:,})")
        self.at += n

    def string(self, what: str) -> str:
        n = self.take("<Q", f"the length of {what}")
        start = self.at
        self.skip(n, what)
        try:
            return str(self.buf[start:self.at], "utf-8")  # GGUF's strings are UTF-8; readers decode them
        except UnicodeDecodeError as exc:
            raise HeaderError(f"{what} (byte {start:,}) is not UTF-8: {exc.reason}") from None

    def strings(self, n: int, what: str) -> list[str]:
        """`n` strings in a row (a vocabulary: 262k of them), as `string` reads them, without its cost per call
        (its messages are formatted up front): a string `string` would refuse goes to it, which raises."""
        out, buf, size, length = [], self.buf, self.size, _U64.unpack_from
        for _ in range(n):
            at = self.at
            end = at + 8 + length(buf, at)[0] if at + 8 <= size else size + 1
            if end <= size:
                try:
                    out.append(str(buf[at + 8:end], "utf-8"))
                    self.at = end
                    continue
                except UnicodeDecodeError:
                    pass
            out.append(self.string(what))
        return out

    def count(self, n: int, least: int, what: str) -> int:
        if n * least > self.size - self.at:
            raise HeaderError(f"{what} is {n:,}: more than the {self.size - self.at:,} bytes left could hold")
        return n


def check_header(path: Path, tensor_types: dict[int, tuple[int, int]]) -> int:
    """Raise `HeaderError` unless every field of `path`'s header is backed by the file; the number of
    tensors. `tensor_types`: each GGML type id -> (elements per block, bytes per block)."""
    return len(tensor_table(path, tensor_types))


def tensor_table(path: Path, tensor_types: dict[int, tuple[int, int]]) -> list[tuple[str, list[int], int, int, int]]:
    """`check_header`'s walk, returning each tensor as (name, GGUF dims (reversed: [k, n]), type id,
    the byte its data starts at in the file, its bytes): what reading the tensors needs."""
    return read_header(path, tensor_types)[1]


def read_header(path: Path, tensor_types: dict[int, tuple[int, int]]) -> tuple[dict, list]:
    """`check_header`'s walk, returning the metadata (key -> value: numbers, strings, lists) and the tensor
    table. What gguf's reader gives, in about a second for a vocabulary of 262k tokens where the reader, which
    makes a numpy view of every string, takes tens of seconds."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise HeaderError(f"{size} bytes: too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta: dict = {}
            return meta, _walk(_Cursor(buf, size), tensor_types, meta)


def _walk(c: _Cursor, tensor_types: dict[int, tuple[int, int]], meta: dict) -> list:
    if c.take("<4s", "the magic") != b"GGUF":
        raise HeaderError("no GGUF magic")
    version = c.take("<I", "the version")
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version} (little-endian 2 or 3 are read)")
    n_tensors = c.count(c.take("<Q", "the tensor count"), MIN_TENSOR, "the tensor count")
    n_kv = c.count(c.take("<Q", "the metadata count"), MIN_KV, "the metadata count")
    alignment, keys = DEFAULT_ALIGNMENT, set()
    for i in range(n_kv):
        key = c.string(f"metadata key {i}")
        if key in keys:
            raise HeaderError(f"metadata key {key!r} appears twice")
        keys.add(key)
        kind = c.take("<I", f"the type of {key!r}")
        meta[key] = _value(c, kind, repr(key), 0)
        if key == "general.alignment" and kind == 4:
            alignment = meta[key]
            if alignment == 0 or alignment & (alignment - 1):
                raise HeaderError(f"general.alignment {alignment} is not a power of two")
    ends = []
    for i in range(n_tensors):
        ends.append(_tensor(c, i, tensor_types, alignment))
    data = -(-c.at // alignment) * alignment
    for name, dims, kind, offset, nbytes in ends:
        if data + offset + nbytes > c.size:
            raise HeaderError(f"tensor {name} ends at byte {data + offset + nbytes:,}, past the end of the file "
                              f"({c.size:,} bytes)")
    return [(name, dims, kind, data + offset, nbytes) for name, dims, kind, offset, nbytes in ends]


def _value(c: _Cursor, kind: int, what: str, depth: int):
    if kind in SIZES:
        return c.take(FORMATS[kind], what)
    if kind == STRING:
        return c.string(what)
    if kind == ARRAY and depth < MAX_DEPTH:
        item = c.take("<I", f"the item type of {what}")
        n = c.count(c.take("<Q", f"the length of {what}"), SIZES.get(item, 8 if item == STRING else 12),
                    f"the length of {what}")
        if item in SIZES:
            start = c.at
            c.skip(n * SIZES[item], what)
            return list(struct.unpack_from(f"<{n}{FORMATS[item][1]}", c.buf, start))
        if item == STRING:
            return c.strings(n, what)
        return [_value(c, item, what, depth + 1) for _ in range(n)]
    raise HeaderError(f"{what} has value type {kind}, which GGUF does not define here")


def _tensor(c: _Cursor, i: int, tensor_types: dict[int, tuple[int, int]], alignment: int) -> tuple:
    name = c.string(f"the name of tensor {i}")
    n_dims = c.take("<I", f"the dimension count of {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise HeaderError(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = [c.take("<Q", f"a dimension of {name}") for _ in range(n_dims)]
    elements = 1
    for d in dims:
        elements *= d
    if not all(dims) or elements > MAX_ELEMENTS:
        raise HeaderError(f"tensor {name} has shape {dims}")
    kind = c.take("<I", f"the type of {name}")
    if kind not in tensor_types:
        raise HeaderError(f"tensor {name} has type {kind}, which this reader does not know")
    block, block_bytes = tensor_types[kind]
    if dims[0] % block:
        raise HeaderError(f"tensor {name}: its rows of {dims[0]} are not whole blocks of {block}")
    offset = c.take("<Q", f"the offset of {name}")
    if offset % alignment:
        raise HeaderError(f"tensor {name} starts at offset {offset}, not a multiple of {alignment}")
    return name, dims, kind, offset, elements // block * block_bytes
