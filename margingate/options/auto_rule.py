"""`auto` on CUDA, by measurement rather than a guess.

On a GPU the batch-invariant kernels (Triton) are dearer than cuBLAS, so whether `batch-invariant`
or `margin` (the fast path, verified at near-ties) is the cheaper guarantee is a property of the
device. `margingate bench` on a CUDA device records it per GPU name: at each batch size it compares
each policy's overhead over `fast`, and `margin` wins where its overhead is the smaller at most of
them (a tie goes to `batch-invariant`, which needs no verifier). `auto` reads that record; a GPU
never measured resolves to `batch-invariant` and the bench names the file it would write.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..paths import cache_root

CONTENDERS = ("fast", "batch-invariant", "margin")


def gpu_name(device: str) -> str | None:
    """The GPU's name, or None where torch sees no GPU."""
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else None


def rule_path(gpu: str) -> Path:
    return cache_root() / "auto" / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', gpu)}.json"


def decide(main: dict) -> dict | None:
    """The rule from a bench report's `main` ({"B8": {policy: {"tokens_per_s": ...}}}), or None when no
    batch size ran all of CONTENDERS."""
    evidence = {}
    for batch, rows in main.items():
        if all(name in rows for name in CONTENDERS):
            fast = rows["fast"]["tokens_per_s"]
            evidence[batch] = {"batch_invariant_overhead": fast / rows["batch-invariant"]["tokens_per_s"] - 1,
                               "margin_overhead": fast / rows["margin"]["tokens_per_s"] - 1}
    if not evidence:
        return None
    wins = sum(e["margin_overhead"] < e["batch_invariant_overhead"] for e in evidence.values())
    return {"policy": "margin" if 2 * wins > len(evidence) else "batch-invariant", "evidence": evidence}


def record(report: dict, device: str) -> Path | None:
    """Write the rule a CUDA bench report implies for this GPU; its path (None: nothing to decide)."""
    rule, gpu = decide(report.get("main", {})), gpu_name(device)
    if rule is None or gpu is None:
        return None
    path = rule_path(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gpu": gpu, **rule}, indent=2))
    return path


def measured(device: str) -> str | None:
    """The policy this GPU's recorded bench chose, or None if it was never measured (or torch sees no GPU)."""
    gpu = gpu_name(device)
    path = rule_path(gpu) if gpu else None
    return json.loads(path.read_text())["policy"] if path and path.exists() else None
