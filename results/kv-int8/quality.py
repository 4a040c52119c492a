"""Quantized KV caches against the bf16 one, beside llama.cpp's q8_0 and q4_0 caches against its f16 one, on the
same tokens: per position, whether the quantized cache's top-1 next token is the full-precision cache's, and the
mean negative log-likelihood of the real next token under each. The text is the built-in prompts' (repeated),
scored in one prompt pass, so every position attends over quantized K/V. Ours at --weights auto; llama.cpp on the
same GGUF, with its Hadamard rotation of quantized K/V (on by default in this build) and without it
(LLAMA_ATTN_ROT_DISABLE=1).

Our variants: the formats offered (`int8`, `int4`: rotated, a scale per 32 values) and, to decide them, the same
codes without the rotation and/or with one scale per 64-value head (int8's format before; both models have head
dim 64), measured by replacing the format table's entry for the run (kernels/kv_format.py: KV_FORMATS).

    .venv/bin/python results/kv-int8/quality.py [--tokens 2000] [--threads 2] [--models ...] [--cache DIR]

(llama.cpp's Python: .venv-llamacpp/bin/python, or MARGINGATE_LLAMACPP_PYTHON.)

Writes results/kv-int8/quality.json and quality.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
MODELS = ("qwen2.5-coder-0.5b", "smollm2-135m")
# ours: label -> (dtype offered, group, rotate); None: the format as offered
OURS = {"bf16": ("bfloat16", None),
        "int8 per head": ("int8", (64, False)), "int8 per head, rotated": ("int8", (64, True)),
        "int8 per 32": ("int8", (32, False)), "int8 (per 32, rotated)": ("int8", None),
        "int4 per 32": ("int4", (32, False)), "int4 (per 32, rotated)": ("int4", None)}
# llama.cpp: label -> (ggml type of K and V, rotation on)
LLAMACPP = {"f16": (1, True), "q8_0": (8, True), "q8_0, no rotation": (8, False),
            "q4_0": (2, True), "q4_0, no rotation": (2, False)}


def ours(model: str, ids: list[int], label: str, threads: int) -> dict:
    from margingate.kernels.kv_format import KV_FORMATS
    from margingate.llm import LLM

    dtype, variant = OURS[label]
    offered = KV_FORMATS[dtype]
    if variant is not None:
        KV_FORMATS[dtype] = dataclasses.replace(offered, group=variant[0], rotate=variant[1])
    try:
        llm = LLM(model, kv_cache_dtype=dtype, num_threads=threads, max_num_seqs=1)
        score = llm.score(ids[:1], ids[1:], top_logprobs=1)
        return {"logprobs": score.logprobs, "argmax": [t.top[0][0] for t in score.tokens],
                "kv_bytes_per_position": llm.engine.kv.bytes_per_block // llm.engine.kv.block_size}
    finally:
        KV_FORMATS[dtype] = offered


def llamacpp(gguf: str, ids: list[int], label: str, threads: int) -> dict:
    ggml_type, rotation = LLAMACPP[label]
    env = dict(os.environ, **({} if rotation else {"LLAMA_ATTN_ROT_DISABLE": "1"}))
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"gguf": gguf, "ids": ids, "threads": threads, "type_k": ggml_type}))
        python = os.environ.get("MARGINGATE_LLAMACPP_PYTHON", str(REPO / ".venv-llamacpp/bin/python"))
        subprocess.run([python, str(HERE / "llamacpp_score.py"), str(job), str(out)], check=True, env=env)
        return json.loads(out.read_text())


def compare(full: dict, quantized: dict) -> dict:
    n = len(full["argmax"])
    nll_full, nll_q = -sum(full["logprobs"]) / n, -sum(quantized["logprobs"]) / n
    return {"positions": n, "top1_agreement": sum(a == b for a, b in zip(full["argmax"], quantized["argmax"])) / n,
            "nll_full": nll_full, "nll_quantized": nll_q, "nll_increase": nll_q - nll_full}


def cached(folder: Path | None, key: str, run) -> dict:
    """`run()`, or its result kept in `folder` from an earlier call with this key (a run takes minutes)."""
    path = folder / (key.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") + ".json") \
        if folder else None
    if path and path.exists():
        return json.loads(path.read_text())
    result = run()
    if path:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    return result


def measure(model: str, tokens: int, threads: int, cache: Path | None) -> dict:
    from margingate.llm import LLM
    from margingate.models.loader import gguf_parts

    ids = LLM(model, num_threads=threads, max_num_seqs=1).tokenizer.encode(builtin_text())
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    gguf = str(gguf_parts(model)[0])
    runs = {label: cached(cache, f"ours {model} {label} {tokens}", lambda: ours(model, ids, label, threads))
            for label in OURS}
    peer = {label: cached(cache, f"llama.cpp {model} {label} {tokens}", lambda: llamacpp(gguf, ids, label, threads))
            for label in LLAMACPP}
    row = {"model": model, "llama_cpp": peer["f16"].get("version"),
           "llama_cpp_rotation_log": {label: r.get("rotation") for label, r in peer.items()},
           "ours": {label: {**compare(runs["bf16"], r), "kv_bytes_per_position": r["kv_bytes_per_position"]}
                    for label, r in runs.items() if label != "bf16"},
           "llama_cpp_vs_f16": {label: compare(peer["f16"], r) for label, r in peer.items() if label != "f16"},
           "bf16_kv_bytes_per_position": runs["bf16"]["kv_bytes_per_position"]}
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict], tokens: int, threads: int, cpu: str) -> str:
    lines = [f"{tokens} tokens of the built-in prompts' text, {threads} threads, every contender; {cpu}", "",
             "| model | cache | K/V bytes per position | top-1 = full-precision cache | NLL increase |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | ours bf16 (the reference) | {r['bf16_kv_bytes_per_position']:,} | | |")
        for label, c in r["ours"].items():
            lines.append(f"| {r['model']} | ours {label} vs bf16 | {c['kv_bytes_per_position']:,} | "
                         f"{c['top1_agreement']:.2%} | {c['nll_increase']:+.4f} |")
        for label, c in r["llama_cpp_vs_f16"].items():
            lines.append(f"| {r['model']} | llama.cpp {label} vs f16 | | {c['top1_agreement']:.2%} | "
                         f"{c['nll_increase']:+.4f} |")
    return "\n".join(lines) + "\n"


def builtin_text() -> str:
    from margingate.data.prompts import builtin_text as text

    return text()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--cache", type=Path, default=None, help="keep each run's result here, and reuse it")
    args = ap.parse_args()
    from margingate.analysis.outputs import machine_line
    from margingate.environment import environment_record
    from margingate.llm import LLM

    cpu = machine_line(environment_record(LLM(args.models[0], num_threads=args.threads, max_num_seqs=1)))
    rows = [measure(model, args.tokens, args.threads, args.cache) for model in args.models]
    (HERE / "quality.json").write_text(json.dumps({"tokens": args.tokens, "threads": args.threads, "cpu": cpu,
                                                   "rows": rows}, indent=1))
    (HERE / "quality.md").write_text(table(rows, args.tokens, args.threads, cpu))
    print(table(rows, args.tokens, args.threads, cpu))


if __name__ == "__main__":
    main()
