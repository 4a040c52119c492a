"""An int8 KV cache against the bf16 one, beside llama.cpp's q8_0 cache against its f16 one, on the same
tokens: per position, whether the int8 cache's top-1 next token is the bf16 cache's, and the mean negative
log-likelihood of the real next token under each. The text is the built-in prompts' (repeated), scored in one
prompt pass, so every position attends over quantized K/V. Ours at --weights auto; llama.cpp on the same GGUF.

    .venv/bin/python results/kv-int8/quality.py [--tokens 2000] [--threads 2]

Writes results/kv-int8/quality.json and quality.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
LLAMACPP_TYPES = {"f16": 1, "q8_0": 8}


def ours(model: str, ids: list[int], dtype: str, threads: int) -> dict:
    from margingate.llm import LLM

    llm = LLM(model, kv_cache_dtype=dtype, num_threads=threads, max_num_seqs=1)
    score = llm.score(ids[:1], ids[1:], top_logprobs=1)
    return {"logprobs": score.logprobs, "argmax": [t.top[0][0] for t in score.tokens],
            "kv_bytes_per_position": llm.engine.kv.bytes_per_block // llm.engine.kv.block_size}


def llamacpp(gguf: str, ids: list[int], cache: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"gguf": gguf, "ids": ids, "threads": threads, "type_k": LLAMACPP_TYPES[cache]}))
        subprocess.run([str(REPO / ".venv-llamacpp/bin/python"), str(HERE / "llamacpp_score.py"), str(job), str(out)],
                       check=True)
        return json.loads(out.read_text())


def compare(full: dict, quantized: dict) -> dict:
    n = len(full["argmax"])
    return {"positions": n, "top1_agreement": sum(a == b for a, b in zip(full["argmax"], quantized["argmax"])) / n,
            "nll_full": -sum(full["logprobs"]) / n, "nll_quantized": -sum(quantized["logprobs"]) / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from margingate.analysis.outputs import machine_line
    from margingate.data.prompts import builtin_text
    from margingate.environment import environment_record
    from margingate.llm import LLM
    from margingate.models.loader import gguf_parts

    rows, cpu = [], None
    for model in MODELS:
        tokenizer_llm = LLM(model, num_threads=args.threads, max_num_seqs=1)
        cpu = cpu or machine_line(environment_record(tokenizer_llm))
        ids = tokenizer_llm.tokenizer.encode(builtin_text())
        ids = (ids * (args.tokens // len(ids) + 1))[:args.tokens]
        del tokenizer_llm
        bf16, int8 = (ours(model, ids, d, args.threads) for d in ("bfloat16", "int8"))
        gguf = str(gguf_parts(model)[0])
        f16, q8 = (llamacpp(gguf, ids, c, args.threads) for c in LLAMACPP_TYPES)
        rows.append({"model": model, "ours_int8_vs_bf16": compare(bf16, int8),
                     "llamacpp_q8_0_vs_f16": compare(f16, q8),
                     "kv_bytes_per_position": {"bf16": bf16["kv_bytes_per_position"],
                                               "int8": int8["kv_bytes_per_position"]}})
        print(json.dumps(rows[-1]), flush=True)
    lines = [f"{args.tokens} tokens of the built-in prompts' text, {args.threads} threads; {cpu}", "",
             "| model | cache | K/V bytes per position | top-1 = full-precision cache | NLL full | NLL quantized |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        o, c, b = r["ours_int8_vs_bf16"], r["llamacpp_q8_0_vs_f16"], r["kv_bytes_per_position"]
        lines.append(f"| {r['model']} | ours int8 vs bf16 | {b['int8']:,} vs {b['bf16']:,} | "
                     f"{o['top1_agreement']:.2%} | {o['nll_full']:.4f} | {o['nll_quantized']:.4f} |")
        lines.append(f"| {r['model']} | llama.cpp q8_0 vs f16 | | {c['top1_agreement']:.2%} | {c['nll_full']:.4f} | "
                     f"{c['nll_quantized']:.4f} |")
    (HERE / "quality.json").write_text(json.dumps({"tokens": args.tokens, "cpu": cpu, "rows": rows}, indent=1))
    (HERE / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
