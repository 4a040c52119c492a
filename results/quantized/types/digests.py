"""Every GGUF type kept quantized under the integer-exact contract, its digest on each int8 path (issue 64).

Per type: a fixed [96, 1024] matrix of valid blocks (tests/test_quantized.random_tensor: random codes, fp16
scales of both signs over a wide range, zeros and subnormals among them) against 37 fixed bf16 rows, through
the scalar reference and every int8 path this CPU runs (a path it lacks is named with its status); the
digest is the first 16 hex digits of the sha256 of the output's bits. Every column must be equal: the
paths add the same exact integers and run the same float epilogue. Writes digests.json and prints a table.

    PYTHONPATH=. .venv/bin/python results/quantized/types/digests.py
"""
from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2] / "tests"))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    from test_quantized import random_tensor

    from margingate.kernels import invariant as K
    from margingate.kernels.quant_pack import quant_weight
    from margingate.models.gguf_quant import TYPES, quant_codes

    g = torch.Generator().manual_seed(64)
    x = (torch.randn(37, 1024, generator=g) * torch.exp(torch.randn(37, 1, generator=g))).to(torch.bfloat16)
    proofs = K.proofs("int8")
    usable = [p["path"] for p in proofs if p["status"] == "passed"]
    before, table = K.path_in_use("int8"), {}
    try:
        for t in TYPES:
            w = quant_weight([quant_codes(random_tensor(t, 96, 1024, seed=64), t)], "int8")
            row = {"scalar reference": digest(K.linear_reference(x, w))}
            for path in usable:
                K.use_path(path)
                row[path] = digest(K.linear(x, w))
            table[t] = row
    finally:
        K.use_path(before)
    info = dict(ln.split(":", 1) for ln in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines() if ":" in ln)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("flags", "").split())
    name = info.get("model name", platform.processor())
    cpu = (f"{name}, family {info.get('cpu family')} model {info.get('model')}; "
           + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx512_vnni", "avx512_bf16", "amx_int8")))
    out = {"cpu": cpu, "paths": {p["path"]: p["status"] for p in proofs}, "digests": table}
    (HERE / "digests.json").write_text(json.dumps(out, indent=1) + "\n")
    cols = ["scalar reference", *usable]
    print(f"CPU: {cpu}; int8 paths: " + ", ".join(f"{p['path']} {p['status']}" for p in proofs))
    print("| type | " + " | ".join(cols) + " | equal |")
    print("|---|" + "---|" * (len(cols) + 1))
    for t, row in table.items():
        print(f"| {t} | " + " | ".join(f"`{row[c]}`" for c in cols) + f" | {len(set(row.values())) == 1} |")


if __name__ == "__main__":
    main()
