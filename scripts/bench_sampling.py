"""Seeded sampling's cost per row (`engine/sampling.scores`) at B = 16 on the embedded model's
vocabulary: temperature alone, with top_p, with top_k + top_p. Run it in two checkouts, alternately,
to compare (PYTHONPATH=checkout python scripts/bench_sampling.py)."""
from __future__ import annotations

import statistics
import time

import torch

from margingate.engine import Request
from margingate.engine.sampling import choose
from margingate.engine.sequence import Sequence
from margingate.options import SamplingParams

VOCAB, B, REPS = 49152, 16, 7
CASES = {"T=0.8": SamplingParams(temperature=0.8, seed=7),
         "T=0.8 top_p=0.9": SamplingParams(temperature=0.8, seed=7, top_p=0.9),
         "T=1 top_p=0.95 top_k=50": SamplingParams(temperature=1.0, seed=7, top_p=0.95, top_k=50)}


def per_row_ms(sp: SamplingParams, logits: torch.Tensor) -> float:
    seqs = [Sequence(Request([1, 2, 3], 8, sampling=sp), None, frozenset()) for _ in range(B)]
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        for i, seq in enumerate(seqs):
            choose(seq, logits[i:i + 1], 100 + i)
        times.append((time.perf_counter() - t) / B)
    return statistics.median(times) * 1e3


def main() -> None:
    logits = torch.randn(B, VOCAB, generator=torch.Generator().manual_seed(0)) * 4  # a 135M model's spread
    print(f"threads {torch.get_num_threads()}, B = {B}, vocab {VOCAB}, median of {REPS}")
    for name, sp in CASES.items():
        print(f"{name:28s} {per_row_ms(sp, logits):7.3f} ms per row")


if __name__ == "__main__":
    main()
