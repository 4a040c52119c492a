"""tau for the table, by `margingate calibrate`'s rule, on the calibration prompts at the table's batch sizes.

`calibrate`'s criterion (`commands/calibrate.py`: `CRITERION`, `SWEPT`, `sweep`) is run as is: `margin` with
the `replay` repair and strict=False (a flip the gate lets through is counted as missed, not rolled back), and
the smallest tau with 100 % sequence determinism and no missed flip over the heterogeneous batches of every
batch size. What differs is the grid: `calibrate` builds it from delta, the spread of batched logits around the
reference's, which its traces read back whole, every step, from the device; here the grid is the points just
above the largest margins at which `fast` first chose another token than the reference (the teacher-forced
flips, read from the margins the runner already brings back), ending at `calibrate`'s own point above the
largest flip (+ 0.0625). No flip seen: tau 0 is swept, and said. There is no fallback: if no point qualifies,
the report says so and margin runs at the largest point swept, marked unqualified.
"""
from __future__ import annotations

import math

from ..analysis.compare import judge
from ..analysis.runs import batches
from ..commands.calibrate import CRITERION, SWEPT, CalibrateConfig, summarise, sweep
from ..options import PolicySpec
from ..policies import FastPolicy
from ..policies.margin import margin_of
from .engines import Lanes, requests_of
from .shapes import digest

ABOVE_LARGEST = 0.0625  # calibrate's teacher-forced point: the largest flip margin plus this


class MarginRecorder(FastPolicy):
    """`fast`, recording each decode step's margin per request."""

    def __init__(self):
        super().__init__(PolicySpec("fast"))
        self.margins: dict[str, list[float]] = {}

    def commit(self, seq, step, verified):
        self.margins.setdefault(seq.request_id, []).append(margin_of(step.scores))
        super().commit(seq, step, verified)


class EngineSweep:
    """`calibrate`'s `Sweep` over the table's engines: runs of `size`-request heterogeneous batches of the
    calibration prompts, judged against the references."""

    def __init__(self, lanes: Lanes, ids: list[list[int]], new: int, sizes: list[int], per_size: int):
        self.lanes, self.ids, self.new, self.sizes = lanes, ids, new, sizes
        # at most `per_size` batches a size: B = 1 over every prompt would cost as much as the rest together
        self.groups = {s: batches(len(ids), s, "hetero")[:per_size] for s in sizes}
        reference = lanes.run(max(sizes), lambda: requests_of(ids, new, PolicySpec("reference"), "ref"))
        self.references = reference.tokens
        self.fast: dict[int, tuple[float, bool, dict]] = {}
        self.flip_margins: list[float] = []

    def _rows(self, size: int, policy, tag: str) -> tuple[list[tuple], float]:
        """Each batch of `size` under `policy` (a spec, or a factory of policy objects): the judged rows'
        input `(prompt index, tokens, stats, None)` and the seconds of the runs."""
        rows, seconds = [], 0.0
        for k, group in enumerate(self.groups[size]):
            run = self.lanes.run(size, lambda: requests_of([self.ids[i] for i in group], self.new, policy,
                                                           f"{tag}{k}-"))
            rows += [(i, r.token_ids, dict(r.stats), None) for i, r in zip(group, run.results)]
            seconds += run.seconds
        return rows, seconds

    def record_fast(self) -> None:
        """fast at every size, with the margin of each first divergence from the reference (a flip)."""
        for size in self.sizes:
            recorder = MarginRecorder()
            rows, seconds = self._rows(size, lambda: recorder, "fast")
            for (i, tokens, _, _), group_row in zip(rows, _request_ids(self.groups[size], "fast")):
                d = judge(self.references, [(i, tokens, {}, None)])[0]["d"]
                if d:  # token d came from decode step d, whose margin is the (d-1)-th recorded
                    self.flip_margins.append(recorder.margins[group_row][d - 1])
            self.fast[size] = (seconds, False, {"rows": rows})

    def fast_seconds(self) -> dict:
        return self.fast

    def margin(self, tau: float, fast: dict) -> dict:
        spec = SWEPT.replace(tau=tau)
        rows, seconds, t_fast, per_size = [], 0.0, 0.0, {}
        for size in self.sizes:
            got, s = self._rows(size, spec, f"m{tau}-")
            judged = judge(self.references, got)
            per_size[str(size)] = summarise(judged, s, fast[size][0])
            rows, seconds, t_fast = rows + judged, seconds + s, t_fast + fast[size][0]
        return {"tau": tau, **summarise(rows, seconds, t_fast), "from_cache": False, "per_batch_size": per_size}


def _request_ids(groups: list[list[int]], tag: str) -> list[str]:
    return [f"{tag}{k}-{j}" for k, g in enumerate(groups) for j in range(len(g))]


def candidate_taus(flip_margins: list[float], points: int) -> list[float]:
    """Just above each of the `points - 1` largest distinct flip margins, then the largest + 0.0625."""
    found = sorted({m for m in flip_margins if math.isfinite(m)})
    if not found:
        return [0.0]
    near = [math.nextafter(m, math.inf) for m in found[-(points - 1):]] if points > 1 else []
    return sorted(set(near) | {found[-1] + ABOVE_LARGEST})


def fit_tau(lanes: Lanes, ids: list[list[int]], new: int, sizes: list[int], per_size: int = 2,
            points: int = 4) -> dict:
    """tau by calibrate's criterion on `ids` (the calibration prompts), and how it was found."""
    s = EngineSweep(lanes, ids, new, sizes, per_size)
    s.record_fast()
    taus = candidate_taus(s.flip_margins, points)
    frontier, chosen = sweep(s, taus, CalibrateConfig(stop_at_first=True, extra_points=0))
    used = chosen if chosen is not None else taus[-1]
    fitted_on = sorted({i for groups in s.groups.values() for g in groups for i in g})
    return {"tau": used, "qualified": chosen is not None, "criterion": CRITERION,
            "rule": ("no flip seen on the calibration prompts: tau 0 swept" if taus == [0.0] else
                     "calibrate's criterion over the points just above the largest flip margins"),
            "flips": len(s.flip_margins), "flip_margins": sorted(s.flip_margins), "taus_swept": taus,
            "frontier": [{k: v for k, v in row.items() if k != "from_cache"} for row in frontier],
            "batch_sizes": sizes, "batches_per_size": per_size, "new": new,
            "prompts": [digest([ids[i]]) for i in fitted_on]}
