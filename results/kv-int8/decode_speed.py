"""Decode speed over a quantized KV cache at ~2k context: B requests (B = 1 and 8) of ~2,000-token prompts on the
embedded model, `batch-invariant` (CPU's deterministic default), prefilled first, then DECODE steps timed
(each step one row per request). One process per K/V dtype; `--tree` runs another checkout's code (today's main,
for int8 as it was), so both sides run in this same locked run.

    flock /tmp/mg-measure.lock .venv/bin/python results/kv-int8/decode_speed.py --baseline /work/main

Writes results/kv-int8/decode_speed.json and decode_speed.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONTEXT, DECODE, WARMUP = 2000, 24, 2


def one(dtype: str, batch: int, threads: int) -> dict:
    """Runs in a child process, under the tree on sys.path: seconds per decode step at `batch` rows."""
    from margingate.data.prompts import builtin_text
    from margingate.engine import Request
    from margingate.llm import LLM

    llm = LLM(kv_cache_dtype=dtype, num_threads=threads, max_num_seqs=batch, policy="batch-invariant")
    ids = llm.tokenizer.encode(builtin_text())
    ids = ids * (CONTEXT // len(ids) + 2)
    prompts = [ids[i * 37:i * 37 + CONTEXT] for i in range(batch)]  # distinct prompts of CONTEXT tokens
    eng = llm.engine
    seqs = [eng.add_request(Request(p, DECODE + WARMUP + 1, llm.policy("batch-invariant"), ignore_eos=True,
                                    request_id=f"r{i}")) for i, p in enumerate(prompts)]
    while any(not s.output_ids for s in seqs):
        eng.step()
    for _ in range(WARMUP):
        eng.step()
    t = time.perf_counter()
    for _ in range(DECODE):
        eng.step()
    seconds = (time.perf_counter() - t) / DECODE
    return {"dtype": dtype, "batch": batch, "ms_per_step": 1e3 * seconds, "tokens_per_s": batch / seconds,
            "context": CONTEXT, "kv_bytes_per_position": eng.kv.bytes_per_block // eng.kv.block_size}


def child(tree: str, dtype: str, batch: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, __file__, "--child", dtype, str(batch), "--threads", str(threads)],
                         env=env, check=True, capture_output=True, text=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="/work/main", help="the checkout whose int8 is 'before'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("DTYPE", "BATCH"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child[0], int(args.child[1]), args.threads)))
        return
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    runs = []
    for batch in args.batches:
        for label, tree, dtype in (("bf16", str(REPO), "bfloat16"), ("int8 before (per head)", args.baseline, "int8"),
                                   ("int8 (per 32, rotated)", str(REPO), "int8"),
                                   ("int4 (per 32, rotated)", str(REPO), "int4")):
            r = child(tree, dtype, batch, args.threads)
            runs.append({"cache": label, **r})
            print(json.dumps(runs[-1]), flush=True)
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    sys.path.insert(0, str(REPO))
    from margingate.analysis.outputs import machine_line
    from margingate.environment import environment_record
    from margingate.llm import LLM

    cpu = machine_line(environment_record(LLM(num_threads=args.threads, max_num_seqs=1)))
    lines = [f"Embedded model (SmolLM2-135M), `batch-invariant`, ~{CONTEXT}-token prompts, {DECODE} decode steps "
             f"timed after {WARMUP}; {cpu}", f"uptime before: {uptime[0]}", f"uptime after: {uptime[1]}", "",
             "| B | cache | K/V bytes per position | ms per step | tokens/s |", "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['batch']} | {r['cache']} | {r['kv_bytes_per_position']:,} | {r['ms_per_step']:.1f} | "
                     f"{r['tokens_per_s']:.1f} |")
    (HERE / "decode_speed.json").write_text(json.dumps({"cpu": cpu, "uptime": uptime, "runs": runs}, indent=1))
    (HERE / "decode_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
