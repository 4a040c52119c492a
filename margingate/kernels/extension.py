"""Building and loading the compiled kernels (`csrc/`): once per content, cached, and loud. A machine that
cannot build or run them gets an error naming what is missing, never a silent fallback to library kernels
that would break the determinism contract. Which linear path runs is `invariant.py`'s concern; this module
knows only how to produce the module.

The build folder is `kernels/torch-<version>-<key>` in the cache, the key a hash of everything the built
module depends on: the bytes of every file in csrc/, the compiler flags, the compiler (`$CXX --version`),
torch's version and Python's extension suffix (`build_key`). Which ISA units are built (the -D defines) is
decided by the compiler and the sources, so the key covers it. Two checkouts of the same code share one
build, and any change of code gets its own. The sources are copied into the folder and built from there:
torch's build command names the files it compiles, so a build from the checkout would differ between
checkouts. A finished build leaves a `built` stamp; a later start imports the module without calling
torch's build, and one without a stamp says on stderr that it builds and why. Builds unused for
PRUNE_AFTER_DAYS are removed when a new one is made.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sysconfig
import time
from pathlib import Path

import torch

from ..errors import KernelBuildError, notice
from ..paths import cache_root
from . import isa_units
from .build_lock import building

NAME = "margingate_invariant"
_CSRC = Path(__file__).parent / "csrc"
# Baseline AVX2 + FMA, no -march=native: the same instructions on every x86 CPU that has them;
# linear_avx512.cpp, linear_avx512bf16.cpp and linear_amx.cpp raise their own target (a pragma),
# each in its own unit, and run only where the CPU has it. -ffp-contract=off: the compiler never fuses a mul and an add.
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
STAMP = "built"
PRUNE_AFTER_DAYS = 30


def _cxx() -> str:
    return os.environ.get("CXX", "c++")  # the compiler torch's build runs


def build_key(csrc: Path, cflags: list[str], ldflags: list[str], compiler: str, torch_version: str) -> str:
    """16 hex digits naming one build: the sources' bytes (by file name, not path), the flags, the
    compiler's identity (`compiler`: its --version text), torch's version and Python's extension suffix."""
    h = hashlib.sha256()
    for f in sorted(p for p in csrc.iterdir() if p.is_file()):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    h.update(repr((cflags, ldflags, compiler, torch_version, sysconfig.get_config_var("EXT_SUFFIX"))).encode())
    return h.hexdigest()[:16]


@functools.cache
def build_dir() -> Path:
    """Where this code's compiled extension is cached (module docstring)."""
    try:
        compiler = isa_units.compiler_version(_cxx())
    except RuntimeError as exc:
        raise KernelBuildError(f"cannot build margingate's invariant kernels: {exc}") from exc
    key = build_key(_CSRC, _CFLAGS, _LDFLAGS, compiler, torch.__version__)
    return cache_root() / "kernels" / f"torch-{torch.__version__}-{key}"


@functools.cache
def load():
    """The compiled module (built on first call for this code, then imported from the cache)."""
    folder = build_dir()
    _ensure_built(folder)
    try:
        mod = _import(folder)
    except (ImportError, OSError) as exc:  # a build whose files were removed or damaged since
        notice(f"the kernel build in {folder} cannot be loaded ({exc}); building it again")
        for stale in (folder / STAMP, folder / f"{NAME}.so"):
            stale.unlink(missing_ok=True)
        _ensure_built(folder)
        mod = _import(folder)
    try:
        os.utime(folder / STAMP)  # in use: not pruned
    except OSError:
        pass  # a read-only cache
    if not mod.cpu_supported():
        raise KernelBuildError("margingate's invariant kernels need a CPU with AVX2 and FMA")
    return mod


def _ensure_built(folder: Path) -> None:
    if not (folder / STAMP).exists():
        with building(folder):
            if not (folder / STAMP).exists():  # else another process built it while this one waited
                _build(folder)


def _build(folder: Path) -> None:
    missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None
               and not (tool == "ninja" and _has_ninja_module())]
    if missing:
        raise KernelBuildError(f"cannot build margingate's invariant kernels: {', '.join(missing)} not found "
                               "(install g++ from your distribution and `pip install ninja`)")
    from torch.utils.cpp_extension import load as build

    earlier = [d for d in folder.parent.glob("torch-*") if (d / STAMP).exists()]
    why = ("the kernel sources, flags, compiler or torch differ from every earlier build here" if earlier
           else "no earlier build in this cache")
    notice(f"building the invariant kernels into {folder} ({why}); this takes 1-3 minutes on 2 cores, "
                  "once for this code (`make` does it at set-up)")
    src = _copy_sources(folder)
    try:  # which ISA units this compiler builds: cached beside the build
        built = isa_units.buildable(src, _CFLAGS, folder / "isa_units.json", _cxx())
    except RuntimeError as exc:
        raise KernelBuildError(f"cannot build margingate's invariant kernels: {exc}") from exc
    sources, defines = isa_units.sources_and_defines(src, built)
    started = time.monotonic()
    try:
        build(name=NAME, sources=sources, extra_include_paths=[str(src)], extra_cflags=_CFLAGS + defines,
              extra_ldflags=_LDFLAGS, build_directory=str(folder), verbose=False)
    except Exception as exc:  # compiler errors, missing headers
        raise KernelBuildError(f"building margingate's invariant kernels failed: {exc}") from exc
    (folder / STAMP).write_text(f"built in {time.monotonic() - started:.0f} s\n")
    notice(f"invariant kernels built in {time.monotonic() - started:.0f} s")
    prune(folder.parent, keep=folder)


def _copy_sources(folder: Path) -> Path:
    """csrc/ copied into the build folder (the key names its bytes, so a copy there is never stale)."""
    src = folder / "src"
    src.mkdir(parents=True, exist_ok=True)
    for f in _CSRC.iterdir():
        if f.is_file() and (not (src / f.name).exists() or (src / f.name).read_bytes() != f.read_bytes()):
            shutil.copyfile(f, src / f.name)
    return src


def _import(folder: Path):
    """The built module, imported from its file (as torch's load does once it has built it)."""
    spec = importlib.util.spec_from_file_location(NAME, folder / f"{NAME}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prune(kernels: Path, keep: Path, days: float = PRUNE_AFTER_DAYS) -> list[Path]:
    """Remove the builds in `kernels` (other than `keep`) that no start has used for `days`."""
    old = [d for d in kernels.glob("torch-*-*") if d != keep and (d / STAMP).exists()
           and time.time() - (d / STAMP).stat().st_mtime > days * 86400]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
    return old


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    os.environ["PATH"] = f"{Path(ninja.BIN_DIR)}{os.pathsep}{os.environ.get('PATH', '')}"
    return True
