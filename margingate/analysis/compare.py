"""Judging runs against the reference, and the rate summaries every measurement reports.

A run is judged by its first divergence from the reference (its flip), the synchronous
steps up to it and whether the whole sequence is identical. Over judged runs: sequence
determinism, the synchronous flip rate, and the policies' counters from their
determinism reports (trigger, repair and replay rates per decode step; rollbacks and
missed flips summed). A report lacks the counters of a policy that does not verify:
they count 0 there.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: the counters a verifying policy's report holds (VerifyState.stats), summed over requests
COUNTERS = ("triggers", "repairs", "replayed_tokens", "rollbacks", "missed_flips", "discarded_tokens")


def reference_tokens(refs: list[dict]) -> list[list[int]]:
    """The token ids of traced references (what runs are judged against)."""
    return [r["tokens"] for r in refs]


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


def judge(references: Sequence[list[int]] | Mapping[int, list[int]], rows: Iterable[tuple]) -> list[dict]:
    """Judge each run row `(prompt index, token ids, stats, trace or None)` (a `CachedRuns` row)
    against `references[prompt index]`: the prompt, its Judgement, trace, stats and tokens."""
    out = []
    for i, tokens, stats, trace in rows:
        j = Judgement.of(references[i], tokens)
        out.append({"prompt": i, "identical": j.identical, "d": j.divergence, "sync": j.synchronous_steps,
                    "trace": trace, "stats": stats, "tokens": tokens})
    return out


def flip_rates(judged: list[dict]) -> dict:
    """Flips (runs that diverge), the synchronous flip rate and sequence determinism."""
    n = len(judged)
    flips = sum(not r["identical"] for r in judged)
    sync = sum(r["sync"] for r in judged)
    return {"runs": n, "flips": flips, "synchronous_steps": sync,
            "flip_rate": flips / sync if sync else None,
            "sequence_determinism": (n - flips) / n if n else None,
            "median_first_flip": float(statistics.median([r["d"] for r in judged if r["d"] is not None]))
            if flips else None}


def counter_totals(stats: Iterable[dict]) -> dict:
    """Decode steps and each policy counter, summed over the requests' reports."""
    stats = list(stats)
    return {key: sum(s.get(key, 0) for s in stats) for key in ("steps", *COUNTERS)}


def gate_rates(stats: Iterable[dict], verifies: bool = True) -> dict:
    """Per decode step: trigger, repair and replay rates; the counters summed. For a policy that
    does not verify (`verifies=False`) they are None: it has no gate, not a gate that never fires."""
    stats = list(stats)
    t = counter_totals(stats)
    steps = t["steps"]
    per_step = lambda key: t[key] / steps if verifies and steps else None  # noqa: E731
    return {"decode_steps": steps, "trigger_rate": per_step("triggers"), "repair_rate": per_step("repairs"),
            "replay_rate": per_step("replayed_tokens"), **{k: t[k] if verifies else None for k in COUNTERS},
            "runs_with_missed_flips": sum(1 for s in stats if s.get("missed_flips")) if verifies else None}


def summary(judged: list[dict], keys: Iterable[str], verifies: bool = True) -> dict:
    """`keys` (in that order) from the flip rates and the gate rates of the judged runs."""
    stats = [r["stats"] for r in judged]
    every = {**flip_rates(judged), **gate_rates(stats, verifies)}
    return {k: every[k] for k in keys}


def overhead(seconds: float, baseline: float) -> float | None:
    """Relative time over the baseline's: 0.25 = 25 % slower."""
    return (seconds - baseline) / baseline if baseline else None
