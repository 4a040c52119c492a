"""Quality of the integer-exact contract beside llama.cpp's, on the same GGUF file and the same tokens
(issue 45). Greedy continuations of held-out built-in prompts by `--weights bf16` (the file's bf16
dequantization; `--reference`: another model's, such as the bf16 model the file was quantized from, so
that the quantization's own error counts too), then each path scores exactly those tokens: top-1
agreement with the bf16 greedy token (a tie counts as agreement) and the mean NLL of that token. Paths:
ours under `--weights auto` (int8 activations), `exact` (the bf16 bits, so 100 % and bf16's NLL by
construction when there is no `--reference`), and llama.cpp on the same file (`make llamacpp-venv`).
Writes quality.json and prints a table.

    .venv/bin/python results/int8/quality.py [--model FILE.gguf] [--reference MODEL] [--prompts 12] [--tokens 48]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def held_out(n: int) -> list:
    from margingate.data.prompts import builtin_prompts
    return builtin_prompts()[-n:]  # the last prompts of the built-in set: not the demo's or the digest's


def continuations(model: str, prompts: list, tokens: int) -> list[tuple[list[int], list[int]]]:
    from margingate.llm import LLM
    llm = LLM(model, weights="bf16", max_num_seqs=len(prompts))
    out = llm.generate(prompts, max_new_tokens=tokens, policy=llm.policy("reference"), ignore_eos=True)
    return [(llm.tokenizer.encode_prompt(p), c.token_ids) for p, c in zip(prompts, out)]


def ours(model: str, weights: str, pairs) -> list[list[tuple[float, bool]]]:
    from margingate.llm import LLM
    llm = LLM(model, weights=weights, max_num_seqs=len(pairs))
    scores = llm.score_batch(pairs, top_logprobs=1)
    return [[(t.logprob, t.top[0][0] == tok or t.top[0][1] == t.logprob) for tok, t in zip(s.token_ids, s.tokens)]
            for s in scores]


def llamacpp(gguf: str, pairs, threads: int) -> list[list[tuple[float, bool]]]:
    python = os.environ.get("MARGINGATE_LLAMACPP_PYTHON", ".venv-llamacpp/bin/python")
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"gguf": gguf, "threads": threads, "pairs": pairs}))
        subprocess.run([python, str(HERE / "llamacpp_score.py"), str(job), str(result)], check=True)
        got = json.loads(result.read_text())["scores"]
    return [[(lp, top == tok) for (lp, top), tok in zip(row, cont)] for row, (_, cont) in zip(got, pairs)]


def summary(rows) -> dict:
    flat = [x for r in rows for x in r]
    return {"tokens": len(flat), "agreement": sum(a for _, a in flat) / len(flat),
            "mean_nll": -sum(lp for lp, _ in flat) / len(flat)}


def main() -> None:
    import torch

    from margingate.models.loader import embedded_gguf_path
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--reference", help="whose greedy tokens are scored (--weights bf16); default: --model's")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", default=str(HERE / "quality.json"))
    a = p.parse_args()
    gguf = str(embedded_gguf_path(a.model)) if a.model == "smollm2-135m" else a.model
    pairs = continuations(a.reference or a.model, held_out(a.prompts), a.tokens)
    table = {"ours --weights auto (int8)": summary(ours(a.model, "auto", pairs)),
             "ours --weights exact": summary(ours(a.model, "exact", pairs)),
             "llama.cpp": summary(llamacpp(gguf, pairs, torch.get_num_threads()))}
    reference = a.reference or a.model
    json.dump({"model": a.model, "gguf": gguf, "reference": reference, "paths": table}, open(a.out, "w"), indent=1)
    print(f"{a.model}: {table['llama.cpp']['tokens']} tokens, greedy by {reference} --weights bf16, scored by each "
          "path")
    print(f"{'path':<28} {'top-1 agreement':>16} {'mean NLL':>9}")
    for name, s in table.items():
        print(f"{name:<28} {100 * s['agreement']:>15.1f}% {s['mean_nll']:>9.4f}")


if __name__ == "__main__":
    sys.exit(main())
