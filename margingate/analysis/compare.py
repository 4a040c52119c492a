"""Judging runs against the reference: flips, synchronous steps, sequence determinism."""
from __future__ import annotations

from dataclasses import dataclass


def first_divergence(ref: list[int], out: list[int]) -> int | None:
    """Index of the first differing output token (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(ref, out)):
        if a != b:
            return i
    return None if len(ref) == len(out) else min(len(ref), len(out))


@dataclass
class Judgement:
    identical: bool
    divergence: int | None      # output index of the first flip
    synchronous_steps: int      # decode steps up to and including the first divergence

    @classmethod
    def of(cls, ref: list[int], out: list[int]) -> Judgement:
        d = first_divergence(ref, out)
        # token 0 comes from the prefill (shared by every policy); decode steps produce tokens 1..
        steps = max(len(ref), len(out)) - 1 if d is None else max(d, 1)
        return cls(d is None, d, steps)
