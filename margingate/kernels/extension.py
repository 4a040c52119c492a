"""Building and loading the compiled kernels (`csrc/`): once per torch version and compiler, cached, and
loud. A machine that cannot build or run them gets an error naming what is missing, never a silent
fallback to library kernels that would break the determinism contract. Which linear path runs is
`invariant.py`'s concern; this module knows only how to produce the module."""
from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..errors import KernelBuildError
from . import isa_units

_CSRC = Path(__file__).parent / "csrc"
# Baseline AVX2 + FMA, no -march=native: the same instructions on every x86 CPU that has them;
# linear_avx512.cpp, linear_avx512bf16.cpp and linear_amx.cpp raise their own target (a pragma),
# each in its own unit, and run only where the CPU has it. -ffp-contract=off: the compiler never fuses a mul and an add.
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


def build_dir() -> Path:
    """Where the compiled extension is cached, keyed by torch version."""
    root = Path(os.environ.get("MARGINGATE_CACHE", Path.home() / ".cache" / "margingate"))
    path = root / "kernels" / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def load():
    """The compiled module (built on first call, then loaded from the cache)."""
    missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None
               and not (tool == "ninja" and _has_ninja_module())]
    if missing:
        raise KernelBuildError(f"cannot build margingate's invariant kernels: {', '.join(missing)} not found "
                               "(install g++ from your distribution and `pip install ninja`)")
    from torch.utils.cpp_extension import load as build

    sources, defines = isa_units.sources_and_defines(_CSRC, units_built())
    lock = build_dir() / "lock"  # torch's build lock: held while another process builds, left by a killed build
    if lock.exists():
        warnings.warn(f"waiting for {lock}: another process is building margingate's kernels, or a build "
                      "that was stopped left it behind (then delete it)", stacklevel=2)
    try:
        mod = build(name="margingate_invariant", sources=sources,
                    extra_include_paths=[str(_CSRC)], extra_cflags=_CFLAGS + defines,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir()), verbose=False)
    except Exception as exc:  # compiler errors, missing headers
        raise KernelBuildError(f"building margingate's invariant kernels failed: {exc}") from exc
    if not mod.cpu_supported():
        raise KernelBuildError("margingate's invariant kernels need a CPU with AVX2 and FMA")
    return mod


@functools.cache
def units_built() -> dict[str, bool]:
    """{ISA path: whether this machine's compiler builds its unit} (isa_units; cached per compiler)."""
    try:
        return isa_units.buildable(_CSRC, _CFLAGS, build_dir() / "isa_units.json", os.environ.get("CXX", "c++"))
    except RuntimeError as exc:
        raise KernelBuildError(f"cannot build margingate's invariant kernels: {exc}") from exc


def _has_ninja_module() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    os.environ["PATH"] = f"{Path(ninja.BIN_DIR)}{os.pathsep}{os.environ.get('PATH', '')}"
    return True
