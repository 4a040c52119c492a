"""Throughput of margingate's `fast` policy vs Hugging Face `transformers.generate`, batch for batch.

What is measured, for each batch size B (default 1, 8, 16):
  * the same built-in prompts (chat template via `llm.tokenizer.encode_prompt`, so both sides get
    identical token ids), split into groups of B;
  * ours: one `Engine` with max_batch_size=B per B, the B requests of a group submitted at once
    (`llm.requests(..., policy=llm.policy("fast"), ignore_eos=True)` -> `engine.generate`);
  * HF: `LlamaForCausalLM` (bf16) on the same ids, left padded with an attention mask,
    `generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`, pad token = EOS;
  * exactly N new tokens per request on both sides (EOS ignored), same torch thread count;
  * one untimed warm-up group of each side per B, then HF and ours interleaved group by group
    (the order alternates) so machine noise hits both;
  * end-to-end wall time and output tokens/s (prefill included), and a decode-only rate:
    wall time minus prefill (ours: the engine's prefill counter; HF: time until the first
    logits processor call, i.e. the end of the prefill forward), over B*(N-1) decoded tokens;
  * `same` = fraction of requests whose N greedy tokens match between the two (a sanity check;
    bf16 batching/padding may legitimately flip near-ties).

Command (from the repository root):
    PYTHONPATH=. .venv/bin/python benchmarks/bench_vs_hf.py --batch-sizes 1,8,16 --new-tokens 64 \
        --prompts 16 --repeats 1 --out results/bench_vs_hf
Writes <out>.json (machine info + per batch size numbers) and <out>.md (the table, also printed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from margingate.data.prompts import builtin_prompts
from margingate.engine import Engine, EngineConfig
from margingate.llm import LLM


class PrefillClock(LogitsProcessor):
    """Records when generate first asks for logits processing: the prefill forward is done."""
    def __init__(self):
        self.t_first = None

    def __call__(self, input_ids, scores):
        if self.t_first is None:
            self.t_first = time.perf_counter()
        return scores


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_hf(hf, ids: list[list[int]], n: int, eos: int) -> tuple[float, float, list[list[int]]]:
    """One HF generate call on a left-padded group; returns (wall s, prefill s, new tokens)."""
    width = max(map(len, ids))
    input_ids = torch.tensor([[eos] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    clock = PrefillClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=eos, logits_processor=LogitsProcessorList([clock]))
    wall = time.perf_counter() - t0
    return wall, clock.t_first - t0, out[:, width:].tolist()


def run_ours(llm: LLM, engine: Engine, group, n: int) -> tuple[float, float, list[list[int]]]:
    """One engine.generate call on a group submitted at once; returns (wall s, prefill s, tokens)."""
    reqs = llm.requests(group, max_new_tokens=n, policy=llm.policy("fast"), ignore_eos=True)
    before = engine.counters["prefill_seconds"]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    return wall, engine.counters["prefill_seconds"] - before, [r.token_ids for r in results]


def bench(args) -> dict:
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_batch_size=1, num_threads=args.threads)
    prompts = (builtin_prompts() * args.prompts)[: args.prompts]
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    n, eos = args.new_tokens, llm.config.eos_token_ids[0]
    hf = LlamaForCausalLM.from_pretrained(str(llm.folder), dtype=torch.bfloat16).eval()
    max_len = max(map(len, ids)) + n + 8
    rows = []
    for b in args.batch_sizes:
        engine = Engine(llm.model, EngineConfig(b, max_len, args.threads), lambda: llm.policy("fast"))
        torch.set_num_threads(args.threads)  # the engine sets it too; keep both sides identical
        groups = [list(range(i, min(i + b, len(prompts)))) for i in range(0, len(prompts), b)]
        run_hf(hf, [ids[i] for i in groups[0]], n, eos)                  # warm-ups, untimed
        run_ours(llm, engine, [prompts[i] for i in groups[0]], n)
        tot = {"hf": [0.0, 0.0], "ours": [0.0, 0.0]}
        toks = {"hf": {}, "ours": {}}
        bar = tqdm(total=2 * len(groups) * args.repeats, desc=f"B={b}", leave=False)
        for rep in range(args.repeats):
            for gi, g in enumerate(groups):
                order = ("hf", "ours") if (gi + rep) % 2 == 0 else ("ours", "hf")
                for side in order:
                    if side == "hf":
                        wall, pre, out = run_hf(hf, [ids[i] for i in g], n, eos)
                    else:
                        wall, pre, out = run_ours(llm, engine, [prompts[i] for i in g], n)
                    tot[side][0] += wall
                    tot[side][1] += pre
                    toks[side].update(zip(g, out))
                    bar.update(1)
        bar.close()
        out_tokens = len(prompts) * n * args.repeats
        dec_tokens = len(prompts) * (n - 1) * args.repeats
        row = {"batch_size": b, "groups": len(groups), "output_tokens": out_tokens}
        for side in ("hf", "ours"):
            wall, pre = tot[side]
            row[side] = {"wall_s": wall, "prefill_s": pre, "tok_per_s": out_tokens / wall,
                         "decode_tok_per_s": dec_tokens / (wall - pre)}
        assert all(len(t) == n for s in toks.values() for t in s.values()), "a side did not emit N tokens"
        row["ratio"] = row["ours"]["tok_per_s"] / row["hf"]["tok_per_s"]
        row["decode_ratio"] = row["ours"]["decode_tok_per_s"] / row["hf"]["decode_tok_per_s"]
        row["same_outputs"] = sum(toks["hf"][i] == toks["ours"][i] for i in toks["hf"]) / len(prompts)
        rows.append(row)
        del engine
    return {"machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                        "python": platform.python_version(), "platform": platform.platform()},
            "settings": {"model": args.model, "prompts": len(prompts), "new_tokens": n, "repeats": args.repeats,
                         "prompt_tokens": [len(p) for p in ids], "policy": "fast"},
            "environment": llm.environment(), "results": rows}


def table(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = [f"# margingate `fast` vs HF generate ({s['model']}, {s['prompts']} prompts x {s['new_tokens']} "
             f"new tokens, EOS ignored, repeats={s['repeats']})", "",
             f"CPU: {m['cpu']} ({m['cpu_count']} cores), torch threads {m['threads']}, torch {m['torch']}, "
             f"transformers {m['transformers']}", "",
             "| B | HF tok/s | ours tok/s | ours/HF | HF decode tok/s | ours decode tok/s | decode ours/HF "
             "| HF wall s | ours wall s | same outputs |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        h, o = r["hf"], r["ours"]
        lines.append(f"| {r['batch_size']} | {h['tok_per_s']:.1f} | {o['tok_per_s']:.1f} | {r['ratio']:.2f}x "
                     f"| {h['decode_tok_per_s']:.1f} | {o['decode_tok_per_s']:.1f} | {r['decode_ratio']:.2f}x "
                     f"| {h['wall_s']:.1f} | {o['wall_s']:.1f} | {r['same_outputs']:.0%} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="results/bench_vs_hf")
    args = ap.parse_args()
    report = bench(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=2))
    md = table(report)
    Path(f"{out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
