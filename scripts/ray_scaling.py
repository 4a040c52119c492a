"""Throughput of `generate` on Ray workers against one local engine, on one machine.

For each policy and each (workers x threads) shape, a warm pool (every actor's engine loaded,
one short call done) decodes the same prompts; the time is the `generate` call alone (sharding,
transfers, decode, results back), not Ray's start or the model loads. The local engine (all
cores) runs the same requests as the baseline. Tokens are compared with the local run.

    python scripts/ray_scaling.py --prompts-file results/ray/held_in_32.jsonl --out results/ray/scaling
"""
from __future__ import annotations

import argparse
import json
import os
import time

import ray

from margingate.cli import build_parser
from margingate.data.prompts import load_prompts_file
from margingate.distributed.offline import WorkerPool
from margingate.llm import LLM
from margingate.options import PolicySpec


def timed(engine, llm, prompts, policy: str, max_new_tokens: int, repeats: int = 1) -> tuple[float, list[list[int]]]:
    """The best of `repeats` runs (the machine may be shared), and the tokens (the same every run)."""
    best, tokens = float("inf"), None
    for _ in range(repeats):
        reqs = llm.requests(prompts, max_new_tokens=max_new_tokens)
        for r in reqs:
            r.policy = llm.policy(PolicySpec(policy))
        t = time.perf_counter()
        results = engine.generate(reqs)
        best = min(best, time.perf_counter() - t)
        assert tokens is None or tokens == [r.token_ids for r in results] or policy == "fast"
        tokens = [r.token_ids for r in results]
    return best, tokens


def row(policy: str, shape: str, seconds: float, tokens: list[list[int]], base: list[list[int]]) -> dict:
    n = sum(map(len, tokens))
    # the machine may be shared: the 1-minute load average says how much (2 cores: 2.0 is full)
    return {"policy": policy, "shape": shape, "seconds": seconds, "tokens": n, "tok_per_s": n / seconds,
            "same_tokens_as_local": tokens == base, "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts-file", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--policies", default="fast,batch-invariant")
    p.add_argument("--shapes", default="1x2,2x1", help="workers x threads per worker")
    p.add_argument("--repeats", type=int, default=1, help="time the best of this many runs")
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    a = p.parse_args()
    prompts = load_prompts_file(a.prompts_file)
    llm = LLM(max_num_seqs=16)  # the local baseline at all cores, and the tokenizer
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    rows = []
    for policy in a.policies.split(","):
        base_s, base = timed(llm.engine, llm, prompts, policy, a.max_new_tokens, a.repeats)
        rows.append(row(policy, f"local engine, {llm.engine.num_threads} threads", base_s, base, base))
        for shape in a.shapes.split(","):
            workers, threads = map(int, shape.split("x"))
            args = build_parser().parse_args(["generate", "--ray"])
            pool = WorkerPool(args, workers=workers, threads=threads, max_num_seqs=16)
            timed(pool, llm, prompts[:workers], policy, 2)  # warm: every actor loaded
            s, tokens = timed(pool, llm, prompts, policy, a.max_new_tokens, a.repeats)
            pool.shutdown()
            rows.append(row(policy, f"Ray, {workers} worker(s) x {threads} thread(s)", s, tokens, base))
            print(rows[-1], flush=True)
    ray.shutdown()
    with open(f"{a.out}.json", "w") as f:
        json.dump({"environment": llm.environment(), "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
                   "repeats": a.repeats, "rows": rows}, f, indent=2)
    lines = ["| policy | run on | tokens | seconds | tok/s | same tokens as local | load avg (1 min) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['shape']} | {r['tokens']} | {r['seconds']:.1f} | {r['tok_per_s']:.0f} | "
              f"{'yes' if r['same_tokens_as_local'] else 'no'} | {r['load_avg_1m']:.1f} |" for r in rows]
    with open(f"{a.out}.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
