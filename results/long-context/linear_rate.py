"""The linear layers of one 4,096-row prefill chunk of Qwen2.5-Coder-0.5B: our compiled linear (the contract's
order, on the path this CPU runs) beside torch's own bf16 matmul (oneDNN) on the same bf16 weights, at the same
thread count. Random weights of the model's shapes: the rate depends on the shapes, not on the values.

    .venv/bin/python results/long-context/linear_rate.py [--rows 4096] [--threads 2]

Prints a markdown table (GFLOP/s and the ratio) and writes linear_rate.json beside this script.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
# Qwen2.5-0.5B: hidden 896, 14 query heads and 2 KV heads of 64, intermediate 4,864 (gate and up fused)
SHAPES = {"qkv": (1152, 896), "o_proj": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    from margingate.kernels import invariant as K
    from margingate.kernels.packing import pack

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(args.rows, k, generator=g).to(torch.bfloat16)
        packed = pack(w)
        ours = best_of(lambda: K.linear(x, packed), args.repeats)
        lib = best_of(lambda: torch.nn.functional.linear(x, w), args.repeats)
        flop = 2 * args.rows * n * k
        rows.append({"layer": name, "n": n, "k": k, "ours_gflops": flop / ours / 1e9, "torch_gflops": flop / lib / 1e9})
    total_ours = sum(2 * args.rows * r["n"] * r["k"] / (r["ours_gflops"] * 1e9) for r in rows)
    total_lib = sum(2 * args.rows * r["n"] * r["k"] / (r["torch_gflops"] * 1e9) for r in rows)
    print(f"{args.rows} rows, {args.threads} threads, path {K.path_in_use('bf16')}\n")
    print("| layer | n x k | ours GFLOP/s | torch bf16 GFLOP/s | ours / torch |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['n']} x {r['k']} | {r['ours_gflops']:.0f} | {r['torch_gflops']:.0f} | "
              f"{r['ours_gflops'] / r['torch_gflops']:.2f} |")
    print(f"| one layer's four | | {total_ours * 1e3:.1f} ms | {total_lib * 1e3:.1f} ms | "
          f"{total_lib / total_ours:.2f} |")
    (HERE / "linear_rate.json").write_text(json.dumps({"rows": args.rows, "threads": args.threads,
                                                       "path": K.path_in_use("bf16"), "layers": rows}, indent=1))


if __name__ == "__main__":
    main()
