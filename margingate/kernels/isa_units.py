"""Which instruction-set units of the linear the compiler can build.

Each ISA path (`csrc/linear_amx.cpp`, `linear_avx512bf16.cpp`, `linear_avx512.cpp`, and the int8 contract's
`linear_int8_amx.cpp` and `linear_int8_vnni.cpp`) is its own
translation unit under its own target pragma. A compiler that lacks a target (GCC before 11 has no
AMX intrinsics) must not fail the whole build on a CPU that never needs that path: the unit is left
out, the path reported "not built", and the rest builds. The probe compiles the unit itself, once
per compiler, and is cached beside the build.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

# path name -> (its unit, the macro that tells linear_paths.cpp it is built)
UNITS = {"amx": ("linear_amx.cpp", "MG_BUILT_AMX"), "avx512bf16": ("linear_avx512bf16.cpp", "MG_BUILT_AVX512BF16"),
         "avx512": ("linear_avx512.cpp", "MG_BUILT_AVX512"),
         "int8-amx": ("linear_int8_amx.cpp", "MG_BUILT_INT8_AMX"),
         "int8-avx512vnni": ("linear_int8_vnni.cpp", "MG_BUILT_INT8_VNNI")}


def compiler_version(cxx: str = "c++") -> str:
    """`cxx --version`'s text: the compiler's identity in cache keys."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout.strip()
        if not out:
            raise IndexError("it printed no version")
        return out
    except (OSError, subprocess.CalledProcessError, IndexError) as exc:
        raise RuntimeError(f"no C++ compiler ({cxx}): {exc}") from exc


def buildable(csrc: Path, cflags: list[str], cache: Path, cxx: str = "c++") -> dict[str, bool]:
    """{path: whether `cxx` compiles its unit}, cached in `cache` per compiler version, flags and sources."""
    key = {"compiler": compiler_version(cxx), "flags": cflags,
           "sources": {name: hashlib.sha256((csrc / unit).read_bytes()).hexdigest()
                       for name, (unit, _) in UNITS.items()}}
    try:
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved["built"]
    except (OSError, ValueError):
        pass
    built = {name: _compiles(csrc / unit, csrc, cflags, cxx) for name, (unit, _) in UNITS.items()}
    built["int8-amx"] = built["int8-amx"] and built["int8-avx512vnni"]  # its tail rows run on the VNNI kernel
    cache.write_text(json.dumps({"key": key, "built": built}, indent=1))
    return built


def _compiles(unit: Path, include: Path, cflags: list[str], cxx: str) -> bool:
    flags = [f for f in cflags if f != "-O3"] + ["-O0", "-std=c++17", f"-I{include}"]
    done = subprocess.run([cxx, *flags, "-c", str(unit), "-o", "/dev/null"], capture_output=True, text=True)
    return done.returncode == 0


def sources_and_defines(csrc: Path, built: dict[str, bool]) -> tuple[list[str], list[str]]:
    """The .cpp files to build (ISA units only where built) and the -D flags that say which are."""
    skip = {unit for name, (unit, _) in UNITS.items() if not built[name]}
    sources = sorted(str(p) for p in csrc.glob("*.cpp") if p.name not in skip)
    return sources, [f"-D{macro}=1" for name, (_, macro) in UNITS.items() if built[name]]
