"""The environment record: what the determinism contract depends on besides the request (model,
device, threads, torch, CPU and ISA, kernels, package versions). Every report records it, the
measurement cache keys its runs by part of it and a saved profile keeps its versions: one writer,
so they cannot disagree on a field."""
from __future__ import annotations

import functools
import os
import platform
from importlib.metadata import PackageNotFoundError, version

from .kernels import VERSION as KERNELS_VERSION

# Fields that describe this start of the model (how long it took, whether its packed matrices came from the
# cache), not what the contract depends on: two starts of the same setup differ in them.
START_FIELDS = ("load_seconds", "weights_cache")
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")  # what decides the library's kernels
# llguidance decides a constrained request's tokens (its masks); gguf reads a GGUF model's values
PACKAGES = ("margingate", "numpy", "transformers", "tokenizers", "llguidance", "gguf")


def environment_record(llm, num_threads: int | None = None) -> dict:
    """`llm`'s environment; `num_threads` overrides its engine's (a worker pool's threads per worker)."""
    import torch  # loaded with `llm` already; imported here so that the commands' --help loads none

    from .kernels import invariant
    from .models.weights import quantized_contract, weight_formats
    contract = quantized_contract(llm.model.own_weights)
    return {"model": llm.model_name, "model_fingerprint": llm.config.fingerprint(),
            "device": str(llm.model.device), "torch": torch.__version__,
            "num_threads": llm.engine.num_threads if num_threads is None else num_threads,
            "default_tau": llm.default_tau, "tau_source": "profile" if llm.profile else "built-in default",
            "machine": platform.machine(), "cpu": cpu_info("model name") or platform.processor() or "unknown",
            "cpu_isa": [f for f in ISA_FLAGS if f in (cpu_info("flags") or "").split()],
            "cpu_count": os.cpu_count(), "kernels_version": KERNELS_VERSION, "kernels": llm.model.kernels,
            "kernels_linear_path": invariant.path_in_use("bf16") if llm.model.kernels == "compiled" else "triton",
            # paths this CPU has that failed their load-time proof (csrc/linear_proof.cpp): {path: why}
            "kernels_linear_refused": invariant.refused_paths("bf16") if llm.model.kernels == "compiled" else {},
            "weights": weight_formats(llm.model.own_weights),  # each matrix group's storage: bf16 or its GGUF types
            # how kept-quantized matrices compute: "int8" (csrc/contract.h, 5), "exact" (their bf16 bits), None
            "quantized_contract": contract,
            "kernels_int8_path": invariant.path_in_use("int8") if contract == "int8" else None,
            # --quantize: the matrices' values are the quantized ones even where they are then held as bf16
            "quantize": llm.quantize,
            # how long the model took to start, and whether its packed matrices were mapped from the cache
            # ("hit"), packed at this start ("miss") or not cached at all (None: bf16 weights, Triton)
            "load_seconds": round(llm.load_seconds, 3), "weights_cache": llm.weights_cache,
            "python": platform.python_version(), "packages": package_versions()}


def contract_part(env: dict) -> dict:
    """A record without its START_FIELDS: what two runs of the same setup must agree on."""
    return {k: v for k, v in env.items() if k not in START_FIELDS}


def kept_quantized(env: dict) -> bool:
    """Whether a record's model keeps any matrix quantized (a GGUF run with --weights auto or exact)."""
    return set(env.get("weights", {}).values()) - {"bf16"} != set()


def versions(env: dict) -> dict:
    """The software versions of a record, as a saved profile keeps them."""
    return {"python": env["python"], "machine": env["machine"], "torch": env["torch"], **env["packages"]}


def package_versions() -> dict:
    """The installed versions of PACKAGES (those not installed left out)."""
    return dict(_package_versions())


# Cached: fixed for the process, and a measurement's cache key reads the record once per run group.
@functools.cache
def _package_versions() -> tuple[tuple[str, str], ...]:
    out = []
    for pkg in PACKAGES:
        try:
            out.append((pkg, version(pkg)))
        except PackageNotFoundError:
            pass
    return tuple(out)


@functools.cache
def cpu_info(key: str) -> str | None:
    """A field of /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None
