"""vLLM's own CPU linear (its prepacked oneDNN `onednn_mm`, what vLLM 0.32 runs for a bf16 Linear on
x86) against torch.nn.functional.linear, on the 1B random model's shapes, 2 threads, GFLOP/s.

    .venv-vllm/bin/python results/bench-v9/onednn_mm.py 16,64,2048

Run in vLLM's venv; compare with `margingate bench-linear --model .cache/random-1b` run just before or
after (two processes on a shared machine: read the ratios loosely).
"""
import sys
import time

import torch
from vllm import _custom_ops as ops

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "head": (49152, 2048)}


def seconds(f, runs: int = 5, each: float = 0.3) -> float:
    """Median over `runs` of the mean time of f over `each` seconds."""
    f()
    times = []
    for _ in range(runs):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < each:
            f()
            n += 1
        times.append((time.perf_counter() - t0) / n)
    return sorted(times)[runs // 2]


def main() -> None:
    torch.set_num_threads(2)
    for m in (int(v) for v in sys.argv[1].split(",")):
        total_mm = total_linear = 0.0
        for name, (n, k) in SHAPES.items():
            w, x = torch.randn(n, k).bfloat16(), torch.randn(m, k).bfloat16()
            handler = ops.create_onednn_mm(w.t(), 32)
            t_mm = seconds(lambda: ops.onednn_mm(handler, x, None))
            t_linear = seconds(lambda: torch.nn.functional.linear(x, w))
            total_mm, total_linear = total_mm + t_mm, total_linear + t_linear
            flops = 2 * m * n * k
            print(f"M={m} {name}: onednn_mm {flops / t_mm / 1e9:.0f} GFLOP/s, F.linear {flops / t_linear / 1e9:.0f}")
        print(f"M={m}: F.linear time / onednn_mm time, summed over the shapes: {total_linear / total_mm:.2f}x")


if __name__ == "__main__":
    main()
