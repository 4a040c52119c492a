"""What the table measures per shape: the check, and each timed point.

The check: every policy on the check prompts, requests joining two per step (batches change as they run),
against each request alone under batch-invariant; and batch-invariant once more on an eager engine, since
the captured graphs must give the same bits as no graphs.

A timed point (one batch size): per policy, `warmup` untimed runs (graphs captured, Triton's kernels built),
then `repeats` timed runs of B requests x `new` tokens. The prefill is the run's first step alone
(`engines.make_engine`), timed apart by the engine; the decode time is the rest of the run, and a decode
step's time is it over the `new - 1` tokens decoded after the prefill's. The increase over fast compares
the medians of the decode times.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from ..options import PolicySpec
from .engines import Lanes, requests_of
from .shapes import digest

DETERMINISTIC = ("batch-invariant", "margin", "dvr", "verify-all")


def specs(tau: float, window: int, group: int) -> dict[str, PolicySpec]:
    """The table's policies: dvr as LLM-42 runs it (its window W and group G), margin at the fitted tau."""
    return {"fast": PolicySpec("fast"), "batch-invariant": PolicySpec("batch-invariant"),
            "margin": PolicySpec("margin", tau=tau), "dvr": PolicySpec("dvr", window=window, group=group),
            "verify-all": PolicySpec("verify-all")}


def check(lanes: Lanes, eager: Lanes, ids: list[list[int]], new: int, policies: dict[str, PolicySpec],
          left: Callable[[], float]) -> dict:
    """Sequence determinism and the token digest of each policy's batch against each request alone; no policy
    starts once `left()` is spent."""
    alone = [lanes.run(1, lambda: requests_of([x], new, PolicySpec("batch-invariant"), "a")).tokens[0]
             for x in ids]
    runs = [(name, lanes, spec) for name, spec in policies.items()]
    runs.append(("batch-invariant, no graphs", eager, PolicySpec("batch-invariant")))
    out = {"prompts": [digest([x]) for x in ids], "alone": {"digest": digest(alone)}, "policies": {}}
    for name, where, spec in runs:
        if left() <= 0:
            out["policies"][name] = {"skipped": "the part's deadline passed"}
            continue
        got = where.run(len(ids), lambda: requests_of(ids, new, spec, "c", arrivals=True)).tokens
        out["policies"][name] = {"sequence_determinism": sum(a == b for a, b in zip(alone, got)) / len(ids),
                                 "digest": digest(got), **where.lane(len(ids)).record()}
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def time_policy(lanes: Lanes, ids: list[list[int]], new: int, spec: PolicySpec, warmup: int, repeats: int) -> dict:
    """One policy at one batch size: the warm-up runs, then the timed ones."""
    batch = len(ids)
    for k in range(warmup):
        lanes.run(batch, lambda: requests_of(ids, new, spec, f"w{k}-"))
    runs = [lanes.run(batch, lambda: requests_of(ids, new, spec, f"t{k}-")) for k in range(repeats)]
    stats = [r.stats for run in runs for r in run.results]
    steps = sum(s.get("steps", 0) for s in stats) or 1
    decode = [run.seconds - run.prefill_seconds for run in runs]
    return {"seconds": [run.seconds for run in runs], "prefill_seconds": [run.prefill_seconds for run in runs],
            "decode_seconds": decode, "decode_ms_per_step": spread([1000 * d / max(new - 1, 1) for d in decode]),
            "prefill_ms": spread([1000 * run.prefill_seconds for run in runs]),
            "trigger_rate": sum(s.get("triggers", 0) for s in stats) / steps,
            "verifier_rows_per_step": sum(s.get("replayed_tokens", 0) for s in stats) / steps,
            "digests": sorted({digest(run.tokens) for run in runs}), **lanes.lane(batch).record()}


def bench_point(lanes: Lanes, ids: list[list[int]], new: int, policies: dict[str, PolicySpec], warmup: int,
                repeats: int, left: Callable[[], float]) -> dict:
    """Every policy at B = len(ids); a policy that fails is reported and the point goes on; none starts
    once `left()` (the part's seconds left) is spent."""
    out: dict = {"prompts": [digest([x]) for x in ids], "policies": {}}
    for name, spec in policies.items():
        if left() <= 0:
            out["policies"][name] = {"skipped": "the part's deadline passed"}
            continue
        try:
            out["policies"][name] = time_policy(lanes, ids, new, spec, warmup, repeats)
        except Exception as exc:  # noqa: BLE001  (one failing policy is reported, the table goes on)
            out["policies"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    fast = out["policies"]["fast"].get("decode_ms_per_step", {}).get("median")
    for row in out["policies"].values():
        if fast and "decode_ms_per_step" in row:
            row["increase"] = row["decode_ms_per_step"]["median"] / fast - 1
    return out
