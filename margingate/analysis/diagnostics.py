"""The paper's diagnostics (§2, App. B-C) computed from traced runs (see traces.py).

A request's first divergence d (output index) is its flip: the batched run and the
reference share the prefix there, so the batched logits at step d (trace index d - 1)
are compared with the reference's, teacher-forced. The column of output token j is
aligned as r = j - d: r < 0 are columns of identical tokens (pure numerical drift),
r = 0 is the flipped token's column.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

TOPK = 16          # batched top-k kept per step (rank / near-tie counts are capped here)
DELTA_K = 8        # delta: batched vs reference logits over the reference's top-8 tokens

EPS_SCALES = (0.0625, 0.125, 0.25, 0.5)   # Table 4: C_eps scales (logits)
RECALL_TAUS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0)
WINDOW = 32        # flip-aligned plots: positions -WINDOW..+WINDOW


def _flip_step(r: dict) -> int | None:
    """Step index (into the trace arrays) of the flip, if it lies in the trace."""
    d = r["d"]
    if d is None or d < 1 or d - 1 >= len(r["trace"]["topv"]):
        return None
    return d - 1


def _stable_steps(r: dict) -> range:
    n = len(r["trace"]["topv"])
    s = _flip_step(r)
    return range(n if r["d"] is None else (s if s is not None else 0))


def step_samples(judged: list[dict], refs: list[dict]) -> dict:
    """Margins, near-tie counts and reference ranks at stable and flip steps (teacher-forced)."""
    stable_v, flip_v, ranks = [], [], []
    for r in judged:
        tv = r["trace"]["topv"]
        st = list(_stable_steps(r))
        if st:
            stable_v.append(tv[st])
        s = _flip_step(r)
        if s is not None:
            flip_v.append(tv[s])
            ref_tok = refs[r["prompt"]]["tokens"][r["d"]]
            hit = np.nonzero(r["trace"]["topi"][s] == ref_tok)[0]
            # rank = 1 + logits strictly above the reference token's (an exact tie ranks 1)
            ranks.append(1 + int((tv[s] > tv[s][hit[0]]).sum()) if len(hit) else TOPK + 1)
    stable = np.concatenate(stable_v) if stable_v else np.zeros((0, TOPK), np.float32)
    flip = np.stack(flip_v) if flip_v else np.zeros((0, TOPK), np.float32)
    return {"stable": stable, "flip": flip, "ranks": ranks}


def rank_table(ranks: list[int]) -> dict:
    n = len(ranks)
    share = lambda k: sum(r <= k for r in ranks) / n if n else None  # noqa: E731
    return {"flips": n, "top1": share(1), "top2": share(2), "top3": share(3), "top8": share(8),
            "outside_top8": (1 - share(8)) if n else None, "max_rank": max(ranks) if n else None,
            "note": f"rank of the reference token in the batched logits at the flip step (1 = batched "
                    f"top-1: an exact tie broken the other way); ranks beyond {TOPK} are reported as {TOPK + 1}"}


def near_tie_counts(samples: dict, scales=EPS_SCALES) -> dict:
    out = {}
    for eps in scales:
        def c(v):
            return (v >= v[:, :1] - eps).sum(1) if len(v) else np.zeros(0)
        cs, cf = c(samples["stable"]), c(samples["flip"])
        ms = float(cs.mean()) if len(cs) else None
        mf = float(cf.mean()) if len(cf) else None
        out[str(eps)] = {"stable": ms, "flip": mf, "ratio": (mf / ms) if ms and mf is not None else None,
                         "stable_steps": int(len(cs)), "flip_steps": int(len(cf))}
    return out


def margins(v: np.ndarray) -> np.ndarray:
    return (v[:, 0] - v[:, 1]) if len(v) else np.zeros(0, np.float32)


def gate_recall(samples: dict, taus=RECALL_TAUS) -> list[dict]:
    """Teacher-forced: share of flips the gate (margin < tau or an exact tie) would catch, and
    the share of synchronous steps it would fire on."""
    ms, mf = margins(samples["stable"]), margins(samples["flip"])
    allm = np.concatenate([ms, mf])
    out = []
    for tau in taus:
        fire = lambda m: (m < tau) | (m == 0)  # noqa: E731
        out.append({"tau": tau, "recall": float(fire(mf).mean()) if len(mf) else None,
                    "trigger_rate": float(fire(allm).mean()) if len(allm) else None})
    return out


def margin_bins(samples: dict) -> list[dict]:
    ms, mf = margins(samples["stable"]), margins(samples["flip"])
    edges = [(0.0, 0.0), (0.0, 0.125), (0.125, 0.25), (0.25, 0.5), (0.5, 1.0), (1.0, math.inf)]
    out = []
    for lo, hi in edges:
        sel = (lambda m: m == 0) if lo == hi else (lambda m, lo=lo, hi=hi: (m > lo) & (m <= hi))
        ns, nf = int(sel(ms).sum()), int(sel(mf).sum())
        out.append({"bin": "0" if lo == hi else f"({lo}, {hi}]", "stable": ns, "flip": nf,
                    "flip_share": nf / (ns + nf) if ns + nf else None})
    return out


def delta_stats(judged: list[dict], refs: list[dict]) -> dict:
    """|batched - reference| logits over the reference's top-k ids at synchronous steps (same prefix)."""
    diffs = []
    for r in judged:
        ar = r["trace"]["at_ref"]
        s_end = len(ar) if r["d"] is None else min(len(ar), r["d"])  # steps 0..d-1 share the prefix
        if s_end <= 0:
            continue
        ref_v = refs[r["prompt"]]["topv"][:s_end, :ar.shape[1]]
        diffs.append(np.abs(ar[:s_end] - ref_v).ravel())
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    if not len(d):
        return {"median": None, "max": None, "samples": 0}
    nz = d[d > 0]
    return {"median": float(np.median(d)), "mean": float(d.mean()), "p99": float(np.quantile(d, 0.99)),
            "max": float(d.max()), "median_nonzero": float(np.median(nz)) if len(nz) else 0.0,
            "share_exact": float((d == 0).mean()), "samples": int(len(d)), "top_k": DELTA_K}


def aligned_deviation(judged: list[dict], window: int = WINDOW) -> dict:
    """Column deviation against position relative to the first flip, per layer (K and V)."""
    with warnings.catch_warnings():  # positions no trial reaches are NaN (mean of an empty slice)
        warnings.simplefilter("ignore", RuntimeWarning)
        return _aligned_deviation(judged, window)


def _aligned_deviation(judged: list[dict], window: int) -> dict:
    trials = [r for r in judged if r["d"] is not None and len(r["trace"]["dev"])]
    if not trials:
        return {"trials": 0}
    layers = trials[0]["trace"]["dev"].shape[1]
    span = np.arange(-window, window + 1)
    acc = np.full((len(trials), len(span), layers, 2), np.nan, np.float32)
    pre_max = np.full((len(trials), layers, 2), np.nan, np.float32)
    slopes = []
    for t, r in enumerate(trials):
        dev, d = r["trace"]["dev"], r["d"]   # dev[j]: column of output token j
        for k, rel in enumerate(span):
            j = d + rel
            if 0 <= j < len(dev):
                acc[t, k] = dev[j]
        if d > 0:
            pre_max[t] = dev[:d].max(0)
        if d >= 3:
            y = dev[:d, -1, 0]
            slopes.append(float(np.polyfit(np.arange(d), y, 1)[0]))
    mean = np.nanmean(acc, axis=0)  # [span, layers, 2]
    zero = window
    pick = {"first": 0, "mid": layers // 2, "last": layers - 1}
    table2 = {}
    for name, idx in (("K", 0), ("V", 1)):
        pre = np.nanmean(acc[:, :zero, -1, idx])
        spike = np.nanmean(acc[:, zero, -1, idx])
        table2[name] = {"pre": float(pre), "spike": float(spike), "ratio": float(spike / pre) if pre > 0 else None}
    table11 = {name: {which: {"pre_mean": float(np.nanmean(acc[:, :zero, li, idx])),
                              "pre_max": float(np.nanmax(pre_max[:, li, idx])),
                              "spike": float(np.nanmean(acc[:, zero, li, idx]))}
                      for which, li in pick.items()}
               for name, idx in (("K", 0), ("V", 1))}
    return {"trials": len(trials), "layers": layers, "window": window, "last_layer": layers - 1,
            "table2": table2, "table11": table11,
            "pre_flip_slope_last_layer_K": {"median": float(np.median(slopes)) if slopes else None,
                                            "trials": len(slopes)},
            "positions": span.tolist(),
            "mean_K": mean[:, :, 0].tolist(), "mean_V": mean[:, :, 1].tolist()}


def repaired_deviation(rows: list[dict]) -> dict:
    """Mean last-layer K/V deviation of the oracle runs aligned to their first fire (App. B.2)."""
    acc: dict[int, list] = {}
    for r in rows:
        if not r["trace"]["fired"] or not len(r["trace"]["dev"]):
            continue
        d = r["trace"]["fired"][0][0]
        dev = r["trace"]["dev"]
        for rel in range(-WINDOW, WINDOW + 1):
            if 0 <= d + rel < len(dev):
                acc.setdefault(rel, []).append(dev[d + rel, -1])
    pos = sorted(acc)
    return {"positions": pos, "mean_K": [float(np.mean([a[0] for a in acc[p]])) for p in pos],
            "mean_V": [float(np.mean([a[1] for a in acc[p]])) for p in pos]}
