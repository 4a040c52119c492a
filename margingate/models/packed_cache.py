"""The packed matrices of a quantized model file, kept in the cache and memory-mapped by later loads.

Building a model from a GGUF repacks each quantized matrix into the kernels' panels (quant_pack) and packs
the rest (packing.pack): seconds to a minute at every start. The first load writes each matrix as
`weights.build` made it into one file, `packed/<file>-<contract>-<key>.safetensors` in the cache; later loads
map that file and repack nothing. The map is private (copy-on-write, never written): its pages are the
page cache's, so every process that loads the model shares one copy in memory (unless the environment asks
for the matrices in the process's own huge pages: weights_memory.py).

The key: the GGUF parts' fingerprint (per part its size, its mtime, and a hash of its first MiB, which holds
the header and metadata, and of SAMPLES pieces of 64 KiB spread over it, the last one its end), the contract
(its layout differs), packing.LAYOUT_VERSION, and a hash of the modules that make the bytes (SOURCES), so
that no code change can reuse bytes an older one made. A file rewritten in place with its size and mtime
kept and changed only between the samples would go unseen: that takes setting its mtime back on purpose.

A first load holds no second copy of the model: each matrix, once made, goes to an unnamed spill file beside
the cache and the model maps it back from there (its anonymous bytes freed at once), so the load's peak holds
one matrix being made, not the whole repacked model. `save` copies the spill into the cache file by reads of
the spill file (no page of its map enters this process) and moves the model's matrices onto the cache file's
map, so a first load ends with what a later one has: the one shared copy, each page resident once touched.

A write goes to a temporary file renamed into place, so a killed process never leaves half a file. A file
that does not parse, is not for this key, lacks a matrix or holds one that is not what its entry says is
named on stderr and rebuilt. Its bytes are not hashed at load: that would read the whole file at each start.
The file is safetensors with every tensor 64-byte aligned, and its `__metadata__` holds the key and each
matrix's kind and shape.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import tempfile
import time
from pathlib import Path

import torch

from ..errors import notice
from ..kernels import packing, quant_pack
from ..kernels.packing import LAYOUT_VERSION, PackedWeight
from ..kernels.quant_pack import QuantWeight
from . import gguf_import, gguf_iq, gguf_quant, gguf_tensors, weights, weights_memory
from .gguf_tensors import TensorTables
from .safetensors_file import DTYPES, read_metadata
from .weights import WeightsError

SAMPLES, SAMPLE_BYTES, HEAD_BYTES, ALIGN = 16, 1 << 16, 1 << 20, 64
HUGE_PAGE = 2 << 20  # a PMD-sized folio: see WholePieces
MIN_BYTES = 32 << 20  # a smaller file packs in well under a second: not worth a file in the cache
PRUNE_AFTER_DAYS = 30
# what decides the packed bytes
SOURCES = (packing, quant_pack, gguf_quant, gguf_iq, gguf_import, gguf_tensors, weights)
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
Packed = PackedWeight | QuantWeight


def fingerprint(parts: list[Path]) -> str:
    """The GGUF parts' fingerprint (module docstring): reads about 2 MiB of each."""
    h = hashlib.sha256()
    for p in parts:
        st = p.stat()
        h.update(f"{st.st_size} {st.st_mtime_ns}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(HEAD_BYTES))
            for i in range(SAMPLES):  # from the start to the very end
                f.seek(max(st.st_size - SAMPLE_BYTES, 0) * i // (SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def cache_key(parts: list[Path], contract: str) -> str:
    h = hashlib.sha256(f"{fingerprint(parts)} {contract} {LAYOUT_VERSION}\0".encode())
    for module in SOURCES:
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:16]


class PackedCache:
    """The packed matrices of one model file under one contract: those found in the cache file, and those
    made by this load (`matrix`), which `save` writes when any were made."""

    def __init__(self, path: Path, key: str, sources: list[Path]):
        self.path, self.key, self.sources = path, key, [str(p.resolve()) for p in sources]
        # the GGUF parts' tensor tables, kept beside the matrices: a hit maps them without walking the header
        # again (its tokenizer's 10^5 strings: 0.45 s on Qwen2.5's 0.5B); the header was checked when they were
        # written, and the key covers the file (its size, mtime and sampled bytes)
        self.tables: TensorTables | None = None
        self.found = self._open()
        self.made: dict[str, Packed] = {}
        self.spill: Spill | None = None  # the made matrices' bytes, written as they are made

    @classmethod
    def for_gguf(cls, parts: list[Path], contract: str, root: Path) -> PackedCache | None:
        """The cache of these GGUF parts under `contract`, in the cache folder `root`; None for a file
        under MIN_BYTES."""
        if sum(p.stat().st_size for p in parts) < MIN_BYTES:
            return None
        key = cache_key(parts, contract)
        return cls(root / "packed" / f"{parts[0].stem}-{contract}-{key}.safetensors", key, parts)

    @property
    def outcome(self) -> str:
        """"hit": every packed matrix came from the file; "miss": this load packed some (and wrote the file)."""
        return "hit" if self.found and not self.made else "miss"

    def matrix(self, name: str, make):
        """Our matrix `name` ("layers.3.qkv", "lm_head.packed"): from the file, else `make()`, kept for `save`
        when it is packed (a plain bf16 matrix, an untied embedding, is the file's own tensor)."""
        if name in self.found:
            return self.found[name]
        made = make()
        if isinstance(made, (PackedWeight, QuantWeight)):
            self.made[name] = made = self._spilled(made)
        return made

    def _spilled(self, m: Packed) -> Packed:
        """`m` with its data mapped back from the spill file, or `m` itself where no spill can be written (a
        read-only cache: then nothing is saved either, and the matrix stays in anonymous memory)."""
        try:
            if self.spill is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.spill = Spill(self.path.parent)
            return type(m)(self.spill.put(m.data), *_fields(m)[1:])
        except OSError:
            return m

    def save(self) -> None:
        """Write the file (what was found and what was made), if this load made anything: atomically, and
        a failure (a full disk, a read-only cache) said on stderr, never raised: the model is loaded."""
        if not self.made:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            prune(self.path.parent)
            _write(tmp, {**self.found, **self.made}, {"key": self.key, "sources": json.dumps(self.sources),
                                                      "tables": json.dumps(self.tables and self.tables.to_json())},
                   self.spill)
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            notice(f"could not keep the packed weights in {self.path} ({exc}); the next load packs them again")
            return
        self._remap()

    def _remap(self) -> None:
        """Move every made matrix onto the cache file's map (Tensor.set_: whoever holds its tensor, an expert set
        too, reads the same storage, now the file's), then drop the spill. Every process that loads this file
        maps the same pages."""
        if self.spill is None:
            return
        mapped, _ = _read(self.path, self.key)
        for name, m in self.made.items():
            m.data.set_(mapped[name].data)
        self.spill.close()
        self.spill = None

    def _open(self) -> dict[str, Packed]:
        if not self.path.exists():
            return {}
        try:
            found, self.tables = _read(self.path, self.key)
        except (WeightsError, ValueError, KeyError, TypeError) as exc:
            notice(f"the packed-weights cache file {self.path} is not usable ({exc}); packing the weights again")
            return {}
        try:
            os.utime(self.path)  # in use: not pruned
        except OSError:
            pass  # a read-only cache
        return found


def _fields(m: Packed) -> tuple:
    return (m.data, m.n, m.k, m.formats, m.contract) if isinstance(m, QuantWeight) else (m.data, m.n, m.k)


class Spill:
    """An unnamed file (gone with the process, however it ends) that takes made matrices one by one: each is
    written at a page boundary (a map's offset must be one) and mapped back privately, so that its bytes leave
    anonymous memory."""

    def __init__(self, folder: Path):
        self.file = tempfile.TemporaryFile(dir=folder)
        self.at: dict[int, tuple[int, int]] = {}  # a mapped tensor's data_ptr -> (offset, bytes) in the file

    def put(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.contiguous().reshape(-1)
        nbytes, at = flat.numel() * flat.element_size(), self.file.seek(0, 2)
        at += -at % mmap.ALLOCATIONGRANULARITY
        self.file.seek(at)
        self.file.write(flat.view(torch.uint8).numpy().data)
        self.file.flush()
        if nbytes == 0:
            return t
        mapped = mmap.mmap(self.file.fileno(), nbytes, offset=at, access=mmap.ACCESS_COPY)
        out = torch.frombuffer(mapped, dtype=t.dtype).view(t.shape)
        self.at[out.data_ptr()] = at, nbytes
        return out

    def copy(self, t: torch.Tensor, dst) -> bool:
        """Write `t`'s bytes to `dst` from the file, never through the map (no page of it enters this process);
        False if `t` is not one of the spill's."""
        if t.data_ptr() not in self.at:
            return False
        at, left = self.at[t.data_ptr()]
        while left:
            chunk = os.pread(self.file.fileno(), min(left, 8 << 20), at)
            dst.write(chunk)
            at, left = at + len(chunk), left - len(chunk)
        return True

    def close(self) -> None:
        self.file.close()  # the maps stay valid while a tensor holds them; set_ has let go of every one


def _write(path: Path, matrices: dict[str, Packed], metadata: dict[str, str], spill: Spill | None = None) -> None:
    tensors = {name: m.data for name, m in matrices.items()}
    entries, at = {}, 0
    for name, t in tensors.items():
        at = -(-at // ALIGN) * ALIGN
        entries[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [at, at + t.numel() * t.element_size()]}
        at = entries[name]["data_offsets"][1]
    kinds = {name: _describe(m) for name, m in matrices.items()}
    header = json.dumps({"__metadata__": {**metadata, "matrices": json.dumps(kinds)}, **entries}).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)  # the data starts aligned
    with open(path, "wb", buffering=0) as raw:
        f = WholePieces(raw)
        f.write(len(header).to_bytes(8, "little") + header)
        for name, t in tensors.items():
            f.write(b"\0" * (entries[name]["data_offsets"][0] - (f.tell() - 8 - len(header))))
            if spill is None or not spill.copy(t, f):
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.close()
        os.fsync(raw.fileno())  # on disk before the rename makes it the cache file


class WholePieces:
    """Writes to a file from its start in whole 2 MiB pieces at 2 MiB offsets, one system call each run of them
    (the file's end excepted). The page cache then holds the file in 2 MiB folios where the kernel and the
    filesystem make them (ext4 and xfs on recent kernels), and every map of it, in any process, takes one TLB
    entry per 2 MiB instead of 512: a B = 1 decode step streams every matrix once (results/roofline). Writes of
    a few MiB at any offset leave most of a 1B model's file in 4 KiB folios. The bytes are the same."""

    def __init__(self, raw):
        self.fd, self.pieces, self.held, self.done = raw.fileno(), [], 0, 0

    def write(self, data) -> None:
        self.pieces.append(memoryview(data).cast("B"))
        self.held += len(self.pieces[-1])
        if self.held >= 4 * HUGE_PAGE:
            self._out(self.held // HUGE_PAGE * HUGE_PAGE)

    def tell(self) -> int:
        return self.done + self.held

    def close(self) -> None:
        self._out(self.held)

    def _out(self, n: int) -> None:
        out = []
        while n:
            p = self.pieces[0]
            out.append(p[:n])
            self.pieces[0] = p[len(out[-1]):]
            n -= len(out[-1])
            if not self.pieces[0]:
                self.pieces.pop(0)
        while out:
            wrote = os.writev(self.fd, out)
            self.done, self.held = self.done + wrote, self.held - wrote
            while out and wrote >= len(out[0]):
                wrote -= len(out.pop(0))
            if out:
                out[0] = out[0][wrote:]


def _describe(m: Packed) -> dict:
    if isinstance(m, QuantWeight):
        return {"kind": "quant", "n": m.n, "k": m.k, "formats": list(m.formats), "contract": m.contract}
    return {"kind": "packed", "n": m.n, "k": m.k}


def _read(path: Path, key: str) -> tuple[dict[str, Packed], TensorTables | None]:
    from .safetensors_file import mmap_safetensors

    meta = read_metadata(path)
    if meta.get("key") != key:
        raise ValueError(f"it was written for key {meta.get('key')!r}, not {key!r}")
    tables = json.loads(meta.get("tables", "null"))
    tables = TensorTables.from_json(tables) if tables else None
    kinds = json.loads(meta["matrices"])
    tensors, out = mmap_safetensors(path, private=weights_memory.private_matrices(kinds)), {}
    for name, kind in kinds.items():
        data = tensors[name]
        if kind["kind"] == "quant":
            m = QuantWeight(data, kind["n"], kind["k"], tuple(kind["formats"]), kind["contract"])
            head = data[:32].view(torch.int64).tolist() if data.dtype == torch.uint8 and data.numel() >= 32 else []
            magic = quant_pack.MAGIC if m.contract == "exact" else quant_pack.MAGIC_INT8
            if head[:3] != [magic, m.n, m.k]:
                raise ValueError(f"{name}'s header is not a {m.contract} matrix of {m.n} x {m.k}")
        else:
            m = PackedWeight(data, kind["n"], kind["k"])
            want = [-(-m.n // packing.PANEL), -(-m.k // packing.BLOCK) * packing.BLOCK // 2, packing.PANEL, 2]
            if data.dtype != torch.bfloat16 or list(data.shape) != want:
                raise ValueError(f"{name} has shape {list(data.shape)}; a packed {m.n} x {m.k} matrix has {want}")
        out[name] = m
    return out, tables


def prune(folder: Path, days: float = PRUNE_AFTER_DAYS) -> None:
    """Remove the files no load has used for `days` or whose GGUF is gone from where it was packed from (a
    test's temporary copy), and the temporary files of writes that were killed (a live write renames its
    own within minutes)."""
    now = time.time()
    for f in [*folder.glob("*.safetensors"), *folder.glob(".*.tmp")]:
        try:
            if now - f.stat().st_mtime > (3600 if f.name.endswith(".tmp") else days * 86400) or \
                    f.suffix == ".safetensors" and not _sources_exist(f):
                f.unlink()
        except OSError:
            pass


def _sources_exist(f: Path) -> bool:
    try:
        return any(Path(p).exists() for p in json.loads(read_metadata(f)["sources"]))
    except (WeightsError, ValueError, KeyError, TypeError):
        return False  # not a file this module wrote whole
