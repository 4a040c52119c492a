"""`margingate selftest`: what this machine computes, in one command.

It prints the CPU (model and the flags that pick a linear path) and torch; each linear path with its
load-time proof (csrc/linear_proof.cpp: a fixed set of small products against the contract's order,
bit for bit) and the one in use; and the token digest of a fixed short run of the model under
`reference`; and how long the model took to start (its packed weights mapped from the cache or not).
The README lists the digests seen and the CPU kinds they were seen on: the same digest
on another machine means the same tokens. Exit status 1 when a path this CPU has was refused.
"""
from __future__ import annotations

import hashlib
import json
import time

from .. import cli_args
from ..data.prompts import builtin_prompts
from ..environment import cpu_info

# the flags that pick a path (bf16 and int8)
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
PROMPTS, NEW_TOKENS = (0, 10, 20, 30), 32  # the digest's run: one prompt per category, greedy


def add_parser(sub) -> None:
    s = sub.add_parser("selftest", help="this CPU's linear paths, each proven at load, and the reference digest")
    s.add_argument("--json", action="store_true")
    cli_args.add_model_args(s)
    s.set_defaults(func=cmd_selftest)


def machine() -> dict:
    import torch  # when the command runs: building the command line loads no torch

    flags = (cpu_info("flags") or "").split()
    return {"cpu": cpu_info("model name") or "unknown", "family": cpu_info("cpu family"), "model": cpu_info("model"),
            "flags": {f: f in flags for f in FLAGS}, "torch": torch.__version__, "threads": torch.get_num_threads()}


def proofs() -> dict:
    from ..kernels import invariant

    invariant.ops()
    t = time.perf_counter()
    paths = invariant.proofs("bf16")
    int8 = invariant.proofs("int8")
    try:
        int8_in_use = invariant.path_in_use("int8")
    except RuntimeError:  # every int8 path refused: the statuses say why
        int8_in_use = None
    return {"paths": paths, "proof_ms": round((time.perf_counter() - t) * 1e3, 1),
            "in_use": invariant.path_in_use("bf16"),
            "int8": int8, "int8_in_use": int8_in_use}


def reference_digest(llm) -> dict:
    """sha256 of the token ids of PROMPTS decoded together under `reference` (each as if alone)."""
    prompts = [builtin_prompts()[i] for i in PROMPTS]
    out = llm.generate(prompts, max_new_tokens=NEW_TOKENS, policy=llm.policy("reference"))
    ids = [c.token_ids for c in out]
    return {"digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16], "model": llm.model_name,
            "prompts": len(prompts), "new_tokens": NEW_TOKENS, "weights": llm.environment()["weights"],
            "quantized_contract": llm.environment()["quantized_contract"]}


def path_lines(paths: list[dict], in_use: str | None) -> list[str]:
    lines = []
    for path in paths:
        mark = "  <- in use" if path["path"] == in_use else ""
        detail = f": {path['detail']}" if path["detail"] else ""
        status = path["status"].upper() if path["status"] == "failed" else path["status"]
        lines.append(f"  {path['path']:<15} {status}{detail}{mark}")
    return lines


def format_report(r: dict) -> str:
    m, p = r["machine"], r["linear"]
    have = " ".join(f for f, on in m["flags"].items() if on)
    lack = " ".join(f for f, on in m["flags"].items() if not on)
    lines = [f"cpu      {m['cpu']} (family {m['family']}, model {m['model']})",
             f"flags    {have}" + (f"   (no {lack})" if lack else ""),
             f"torch    {m['torch']}, {m['threads']} threads; kernels v{r['kernels_version']}",
             f"linear paths, fastest first (each proven against the contract's order; {p['proof_ms']} ms):",
             *path_lines(p["paths"], p["in_use"]),
             "int8 linear paths (quantized matrices, each proven against the int8 scalar reference):",
             *path_lines(p["int8"], p["int8_in_use"])]
    d = r["reference"]
    lines.append(f"reference digest  {d['digest']}  ({d['model']}, {d['prompts']} built-in prompts x "
                 f"{d['new_tokens']} tokens, greedy; compare with the README's table)")
    stored = ", ".join(f"{g} {f}" for g, f in d.get("weights", {}).items())
    contract = d.get("quantized_contract")
    lines.append(f"weights  {stored}  ({'all bf16' if contract is None else contract + ' contract'}: "
                 "the digest differs between --weights auto (int8) and exact or bf16, which share one)")
    load = r["load"]
    lines.append(f"load     {load['seconds']:.2f} s ({CACHE_WORDS[load['weights_cache']]})")
    return "\n".join(lines)


CACHE_WORDS = {"hit": "packed weights mapped from the cache", "miss": "weights packed now, cached for the next start",
               None: "no packed-weights cache for these weights"}


def cmd_selftest(args) -> int:
    from ..kernels import VERSION

    linear = proofs()
    llm = cli_args.llm(args, len(PROMPTS))
    report = {"machine": machine(), "kernels_version": VERSION, "linear": linear, "reference": reference_digest(llm),
              "load": {"seconds": round(llm.load_seconds, 3), "weights_cache": llm.weights_cache}}
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if any(p["status"] == "failed" for p in [*linear["paths"], *linear["int8"]]) else 0
