"""`margingate flips`: the paper's observations (§2, App. B-C) measured on our engine.

Every prompt is decoded by the `reference` policy (the verifier's kernels: its
rows attend over exactly their own prefix, bitwise what decoding alone computes,
so the references run in batches), then by `fast` inside heterogeneous batches
(consecutive prompts of the shuffled set) and homogeneous batches (one prompt
replicated) of each size. Tracing policies (subclasses of the engine's own
policies; the engine is untouched) record per decode step the top-k batched
logits, the batched logits at the reference's top-k token ids and the K/V
column this step wrote, compared with the reference's column at the same position.

Step bookkeeping: output token 0 comes from the prefill (identical everywhere);
decode step k (k >= 1) computes the logits that choose output token k and
writes the K/V column of output token k-1. A request's first divergence d
(output index) is its flip: both runs share the prefix there, so the batched
logits at step d are compared with the reference's teacher-forced. The column
of output token j is aligned as r = j - d: r < 0 are columns of identical tokens
(pure numerical drift), r = 0 is the flipped token's column.

Results of each run are cached on disk keyed by a hash of everything that
determines them (model fingerprint, prompt token ids, settings, threads), so a
re-run with the same settings reuses finished work.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..engine import Request
from ..engine.sequence import Sequence
from ..kernels import VERSION as KERNELS_VERSION
from ..policies import FastPolicy, ReferencePolicy
from .compare import Judgement

CACHE_VERSION = "flips-v1"
TOPK = 16          # batched top-k kept per step (rank / near-tie counts are capped here)
DELTA_K = 8        # delta: batched vs reference logits over the reference's top-8 tokens
EPS_SCALES = (0.0625, 0.125, 0.25, 0.5)   # Table 4: C_eps scales (logits)
RECALL_TAUS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0)
WINDOW = 32        # flip-aligned plots: positions -WINDOW..+WINDOW


# --- traces -----------------------------------------------------------------------

@dataclass
class Trace:
    """Per decode step of one request (step s chooses output token s+1)."""
    tokens: list[int] = field(default_factory=list)
    topv: list = field(default_factory=list)      # [TOPK] fp32 batched logits
    topi: list = field(default_factory=list)      # [TOPK] token ids
    at_ref: list = field(default_factory=list)    # [DELTA_K] batched logits at the reference's top ids
    dev: list = field(default_factory=list)       # [layers, 2] max |K - K_ref|, max |V - V_ref| of the column
    cols: list = field(default_factory=list)      # reference only: [2, layers, kv_heads, head_dim] bf16
    fired: list = field(default_factory=list)     # oracle: (output index, batched argmax differed)

    def pack(self) -> dict:
        out = {"tokens": list(self.tokens), "fired": list(self.fired)}
        out["topv"] = np.array(self.topv, np.float32).reshape(-1, TOPK)
        out["topi"] = np.array(self.topi, np.int32).reshape(-1, TOPK)
        out["at_ref"] = (np.array(self.at_ref, np.float32) if self.at_ref
                         else np.zeros((0, DELTA_K), np.float32))
        out["dev"] = np.stack(self.dev).astype(np.float32) if self.dev else np.zeros((0, 0, 2), np.float32)
        if self.cols:
            out["cols"] = torch.stack(self.cols)
        return out


def _record(trace: Trace, seq: Sequence, logits: torch.Tensor, ref: dict | None, keep_columns: bool) -> None:
    s = len(seq.output_ids) - 1
    assert s == len(trace.topv), "a tracing policy saw a step twice (rollback?)"
    v, i = torch.topk(logits.float(), TOPK)
    trace.topv.append(v.numpy())
    trace.topi.append(i.numpy().astype(np.int32))
    k, vv = seq.read_column(seq.next_pos)
    if keep_columns:
        trace.cols.append(torch.stack([k, vv]))
    if ref is not None and s < len(ref["topi"]):
        idx = torch.from_numpy(ref["topi"][s, :DELTA_K].astype(np.int64))
        trace.at_ref.append(logits.float()[idx].numpy())
    if ref is not None and "cols" in ref and s < len(ref["cols"]):
        trace.dev.append(_column_dev((k, vv), ref["cols"][s]))


def _column_dev(col, ref_col) -> np.ndarray:
    dk = (col[0].float() - ref_col[0].float()).abs().amax(dim=(1, 2))
    dv = (col[1].float() - ref_col[1].float()).abs().amax(dim=(1, 2))
    return torch.stack([dk, dv], dim=1).numpy()


class TraceReference(ReferencePolicy):
    """The reference policy, recording its logits and the columns it writes."""

    def __init__(self, trace: Trace):
        super().__init__("bf16")
        self.trace = trace

    def commit(self, seq, logits, verified):
        _record(self.trace, seq, logits if verified is None else verified[-1], None, keep_columns=True)
        super().commit(seq, logits, verified)


class TraceFast(FastPolicy):
    """Plain batched decoding, recording logits and column deviations against the reference."""

    def __init__(self, trace: Trace, ref: dict | None):
        self.trace, self.ref = trace, ref

    def commit(self, seq, logits, verified):
        _record(self.trace, seq, logits, self.ref, keep_columns=False)
        super().commit(seq, logits, verified)


class OracleRepair(FastPolicy):
    """Table 5: at known flip positions emit the reference token and write the reference's column."""

    def __init__(self, trace: Trace, ref: dict, fire_at: set[int]):
        self.trace, self.ref, self.fire_at = trace, ref, set(fire_at)

    def commit(self, seq, logits, verified):
        k = len(seq.output_ids)
        s = k - 1
        if k in self.fire_at and s < len(self.ref["cols"]) and k < len(self.ref["tokens"]):
            col = self.ref["cols"][s]
            seq.write_column(seq.next_pos, (col[0], col[1]))
            self.trace.fired.append((k, int(torch.argmax(logits)) != self.ref["tokens"][k]))
            _record(self.trace, seq, logits, self.ref, keep_columns=False)
            seq.output_ids.append(int(self.ref["tokens"][k]))
            return
        _record(self.trace, seq, logits, self.ref, keep_columns=False)
        seq.output_ids.append(int(torch.argmax(logits)))


# --- running batches, with a disk cache --------------------------------------------

def batches(n: int, size: int, mode: str, homo_limit: int | None = None) -> list[list[int]]:
    """Prompt indices per batch. hetero: consecutive prompts, wrapping so every batch is full."""
    if mode == "homo":
        return [[i] * size for i in range(min(n, homo_limit or n))]
    if mode == "alone":
        return [[i] for i in range(n)]
    return [[(start + j) % n for j in range(size)] for start in range(0, n, size)]


def settings_key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


class Runner:
    """Runs batches of requests on one LLM, caching each finished run under `cache_dir`."""

    def __init__(self, llm, prompt_ids: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = True,
                 cache_dir: Path | None = None, progress: bool = True, tag: str = ""):
        self.llm, self.ids, self.max_new_tokens = llm, prompt_ids, max_new_tokens
        self.ignore_eos, self.progress, self.tag = ignore_eos, progress, tag
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.base = {"version": CACHE_VERSION, "kernels": KERNELS_VERSION, "model": llm.config.fingerprint(),
                     "prompts": settings_key(prompt_ids), "max_new_tokens": max_new_tokens,
                     "ignore_eos": ignore_eos, "threads": llm.engine.num_threads,
                     "torch": torch.__version__, "device": str(llm.model.device)}

    def key(self, spec: dict) -> str:
        return settings_key({**self.base, **spec})

    def _load(self, key: str):
        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"{key}.pt"
        if path.exists():
            try:
                return torch.load(path, weights_only=False)
            except Exception:  # a broken cache file is recomputed
                return None
        return None

    def _save(self, key: str, value) -> None:
        if self.cache_dir is None:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_dir / f"{key}.tmp"
        torch.save(value, tmp)
        tmp.replace(self.cache_dir / f"{key}.pt")

    def run(self, spec: dict, groups: list[list[int]], make: Callable[[int, int], object],
            desc: str) -> dict:
        """Run every group as one batch; `make(prompt index, row)` -> (policy, trace or None).

        Returns {"rows": [(prompt index, token_ids, stats, packed trace or None)], "seconds": s,
        "cached": bool}. `spec` must describe everything the run depends on beyond the prompts.
        """
        key = self.key(spec)
        hit = self._load(key)
        if hit is not None:
            hit["cached"] = True
            return hit
        engine = self.llm.engine
        if max(len(g) for g in groups) > engine.config.max_batch_size:
            raise ValueError(f"batch size {max(len(g) for g in groups)} exceeds the engine's "
                             f"max_batch_size {engine.config.max_batch_size}")
        rows, seconds = [], 0.0
        for g in tqdm(groups, desc=f"{self.tag}{desc}", disable=not self.progress, leave=False):
            made = [make(i, r) for r, i in enumerate(g)]
            reqs = [Request(self.ids[i], self.max_new_tokens, pol, ignore_eos=self.ignore_eos,
                            request_id=f"r{r}") for r, (i, (pol, _)) in enumerate(zip(g, made))]
            t = time.perf_counter()
            results = engine.generate(reqs)
            seconds += time.perf_counter() - t
            for i, res, (_, tr) in zip(g, results, made):
                packed = None
                if tr is not None:
                    tr.tokens = list(res.token_ids)
                    packed = tr.pack()
                rows.append((i, list(res.token_ids), dict(res.stats), packed))
        out = {"rows": rows, "seconds": seconds, "spec": spec}
        self._save(key, out)
        out["cached"] = False
        return out

    # the runs the analyses need ------------------------------------------------------
    def reference(self) -> list[dict]:
        """One traced reference per prompt (tokens, top-k, columns), batched (bitwise alone)."""
        size = self.llm.engine.config.max_batch_size
        n = len(self.ids)
        groups = [list(range(s, min(n, s + size))) for s in range(0, n, size)]
        run = self.run({"kind": "reference-trace", "rows": size}, groups,
                       lambda i, r: _traced(TraceReference), "reference")
        refs = [None] * n
        for i, _, _, packed in run["rows"]:
            refs[i] = packed
        return refs

    def fast(self, refs: list[dict], mode: str, size: int, homo_limit: int | None = None) -> dict:
        groups = batches(len(self.ids), size, mode, homo_limit)
        ref_key = self.key({"kind": "reference-trace", "rows": self.llm.engine.config.max_batch_size})
        return self.run({"kind": "fast-trace", "mode": mode, "size": size, "homo_limit": homo_limit,
                         "ref": ref_key}, groups,
                        lambda i, r: _traced(lambda t: TraceFast(t, refs[i])), f"fast {mode} b={size}")

    def oracle(self, refs: list[dict], size: int, fire: dict[int, set[int]], round_: int) -> dict:
        groups = batches(len(self.ids), size, "hetero")
        groups = [g for g in groups if any(fire.get(i) for i in g)]
        if not groups:
            return {"rows": [], "seconds": 0.0, "cached": True}
        spec = {"kind": "oracle", "size": size, "round": round_,
                "fire": {str(k): sorted(v) for k, v in sorted(fire.items())}}
        return self.run(spec, groups,
                        lambda i, r: _traced(lambda t: OracleRepair(t, refs[i], fire.get(i, set()))),
                        f"oracle b={size} round {round_}")


def _traced(build) -> tuple:
    t = Trace()
    return build(t), t


# --- analyses ----------------------------------------------------------------------

def judge(refs: list[dict], rows) -> list[dict]:
    """Per run: the prompt, its Judgement and its trace."""
    out = []
    for i, tokens, stats, packed in rows:
        j = Judgement.of(refs[i]["tokens"], tokens)
        out.append({"prompt": i, "identical": j.identical, "d": j.divergence, "sync": j.synchronous_steps,
                    "trace": packed, "stats": stats, "tokens": tokens})
    return out


def flip_rates(judged: list[dict]) -> dict:
    n = len(judged)
    flips = sum(not r["identical"] for r in judged)
    sync = sum(r["sync"] for r in judged)
    return {"runs": n, "flips": flips, "synchronous_steps": sync,
            "flip_rate": flips / sync if sync else None,
            "sequence_determinism": (n - flips) / n if n else None,
            "median_first_flip": float(np.median([r["d"] for r in judged if r["d"] is not None]))
            if flips else None}


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


# --- the command ---------------------------------------------------------------------

@dataclass
class FlipsConfig:
    dataset: str = "builtin"
    limit: int | None = 48
    seed: int = 0
    batch_sizes: list[int] = field(default_factory=lambda: [4, 8, 16])
    homo_sizes: list[int] = field(default_factory=lambda: [4])
    homo_limit: int | None = 8
    oracle_sizes: list[int] = field(default_factory=lambda: [8])
    oracle_rounds: int = 1
    max_new_tokens: int = 128
    max_prompt_tokens: int = 400
    ignore_eos: bool = True


def load_prompts(llm, name: str, limit, seed, max_prompt_tokens):
    from ..data.datasets import dataset_prompts

    prompts = dataset_prompts(name, limit, seed, llm.tokenizer, max_prompt_tokens)
    if not prompts:
        raise ValueError(f"dataset {name!r}: no prompts left after filtering")
    return prompts


def run_flips(llm, cfg: FlipsConfig, cache_dir: Path | None, progress: bool = True) -> dict:
    t0 = time.perf_counter()
    prompts = load_prompts(llm, cfg.dataset, cfg.limit, cfg.seed, cfg.max_prompt_tokens)
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    runner = Runner(llm, ids, cfg.max_new_tokens, ignore_eos=cfg.ignore_eos, cache_dir=cache_dir,
                    progress=progress, tag=f"{cfg.dataset}: ")
    refs = runner.reference()
    table1: dict = {"hetero": {}, "homo": {}}
    timings: dict = {}
    judged_all: dict = {}
    for mode, sizes in (("hetero", cfg.batch_sizes), ("homo", cfg.homo_sizes)):
        for size in sizes:
            run = runner.fast(refs, mode, size, cfg.homo_limit if mode == "homo" else None)
            j = judge(refs, run["rows"])
            judged_all[(mode, size)] = j
            table1[mode][str(size)] = flip_rates(j)
            timings[f"fast_{mode}_{size}"] = round(run["seconds"], 2)
    hetero = [r for (mode, _), js in judged_all.items() if mode == "hetero" for r in js]
    samples = step_samples(hetero, refs)
    per_size = {str(s): rank_table(step_samples(judged_all[("hetero", s)], refs)["ranks"])
                for s in cfg.batch_sizes}
    oracle = {}
    for size in cfg.oracle_sizes:
        oracle[str(size)] = run_oracle(runner, refs, judged_all.get(("hetero", size))
                                       or judge(refs, runner.fast(refs, "hetero", size)["rows"]),
                                       size, cfg.oracle_rounds)
    return {
        "command": "flips", "dataset": cfg.dataset, "settings": vars(cfg) | {"prompts": len(prompts)},
        "prompt_sources": [p.source for p in prompts],
        "prompt_tokens": {"min": min(map(len, ids)), "median": float(np.median([len(x) for x in ids])),
                          "max": max(map(len, ids))},
        "environment": llm.environment(),
        "table1_flip_rate": table1,
        "table1_all_hetero": flip_rates(hetero),
        "table2_table11_kv_deviation": aligned_deviation(hetero),
        "table3_rank_at_flips": {"all": rank_table(samples["ranks"]), "per_batch_size": per_size},
        "table4_near_tie_counts": near_tie_counts(samples),
        "table5_oracle_repair": oracle,
        "margins": {"bins": margin_bins(samples), "gate_recall_teacher_forced": gate_recall(samples),
                    "stable": margins(samples["stable"]).tolist(), "flip": margins(samples["flip"]).tolist()},
        "delta": delta_stats(hetero, refs),
        "timings_s": timings, "seconds": round(time.perf_counter() - t0, 1),
    }


def run_oracle(runner: Runner, refs: list[dict], judged: list[dict], size: int, rounds: int) -> dict:
    """Fire at the fast run's true flip positions; each further round also fires at the first
    divergence the previous round left (a flip at an identical prefix, so a true flip)."""
    fire = {r["prompt"]: {r["d"]} for r in judged if r["d"] is not None}
    flipped = set(fire)
    final: dict[int, dict] = {}
    n_runs = len(judged)
    result_rows = []
    for rnd in range(1, rounds + 1):
        run = runner.oracle(refs, size, fire, rnd)
        result_rows = judge(refs, run["rows"])
        for r in result_rows:
            final[r["prompt"]] = r
        new = {r["prompt"]: r["d"] for r in result_rows if r["d"] is not None}
        if rnd == rounds or not new:
            break
        # the whole batch of a still-diverging prompt reruns; its other rows keep their fires
        fire = {i: (v | ({new[i]} if i in new else set())) for i, v in fire.items()}
    fired = [f for r in final.values() for f in r["trace"]["fired"]]
    repairs = sum(1 for _, differed in fired if differed)
    still = sum(1 for i in flipped if i in final and not final[i]["identical"])
    det_flipped = (len(flipped) - still) / len(flipped) if flipped else None
    return {"runs": n_runs, "flipped_runs": len(flipped), "rounds": rounds,
            "repairs": repairs, "fires": len(fired),
            "repairs_per_sequence": repairs / n_runs if n_runs else None,
            "repairs_per_flipped_sequence": repairs / len(flipped) if flipped else None,
            "sequence_determinism": (n_runs - still) / n_runs if n_runs else None,
            "sequence_determinism_of_flipped": det_flipped,
            "unrepaired_sequence_determinism": (n_runs - len(flipped)) / n_runs if n_runs else None,
            "repaired_dev_last_layer": _repaired_dev(list(final.values())),
            "fires_where_batched_differed": repairs,
            "note": "a fire where the batched argmax equalled the reference means the rerun did not "
                    "reproduce the flip"}


def _repaired_dev(rows: list[dict]) -> dict:
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


# --- report ----------------------------------------------------------------------------

def _f(v, pct=False, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "-"
    if pct:
        return f"{100 * v:.2f}%"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def markdown(rep: dict) -> str:
    s = rep["settings"]
    env = rep["environment"]
    L = [f"# Flip measurements: {rep['dataset']}",
         "",
         f"{s['prompts']} prompts (seed {s['seed']}, prompt tokens {rep['prompt_tokens']['min']}-"
         f"{rep['prompt_tokens']['max']}), {s['max_new_tokens']} new tokens"
         f"{' (EOS ignored)' if s['ignore_eos'] else ''}; model {env['model']} ({env['model_fingerprint']}), "
         f"torch {env['torch']}, {env['num_threads']} threads, {env['device']}. "
         "Reference = the `reference` policy (decoding alone); batched = `fast`.", ""]
    if rep.get("partial"):
        L += [f"**Partial report:** {rep['partial']}.", ""]
    L += ["## Table 1 / App. C: synchronous flip rate", "",
          "| mode | batch | runs | flips | sync. steps | flip rate | seq. det. | median first flip |",
          "|---|---|---|---|---|---|---|---|"]
    for mode, per in rep["table1_flip_rate"].items():
        for size, r in per.items():
            L.append(f"| {mode} | {size} | {r['runs']} | {r['flips']} | {r['synchronous_steps']} | "
                     f"{_f(r['flip_rate'], True)} | {_f(r['sequence_determinism'], True)} | "
                     f"{_f(r['median_first_flip'])} |")
    a = rep["table1_all_hetero"]
    L += [f"| hetero | all | {a['runs']} | {a['flips']} | {a['synchronous_steps']} | {_f(a['flip_rate'], True)} | "
          f"{_f(a['sequence_determinism'], True)} | {_f(a['median_first_flip'])} |", "",
          "Homogeneous batches replicate one prompt (no padding); on this CPU they are bitwise equal to "
          "decoding alone, so their flip rate is 0 by construction of the kernels, not by luck.", ""]
    kv = rep["table2_table11_kv_deviation"]
    if kv.get("trials"):
        L += [f"## Table 2 / Fig. 1: K/V deviation aligned to the first flip (last layer L{kv['last_layer']}, "
              f"{kv['trials']} trials)", "",
              "max |batched - reference| over heads x dims of the column of output token j, at j - d "
              "(d = first flip). pre = mean over j < d (identical tokens), spike = j = d.", "",
              "| K pre | K spike | K ratio | V pre | V spike | V ratio | median pre-flip K slope /token |",
              "|---|---|---|---|---|---|---|",
              f"| {_f(kv['table2']['K']['pre'])} | {_f(kv['table2']['K']['spike'])} | "
              f"{_f(kv['table2']['K']['ratio'])} | {_f(kv['table2']['V']['pre'])} | "
              f"{_f(kv['table2']['V']['spike'])} | {_f(kv['table2']['V']['ratio'])} | "
              f"{_f(kv['pre_flip_slope_last_layer_K']['median'])} |", "",
              "## Table 11: per-layer K/V error (first / middle / last layer)", "",
              "| | K first | K mid | K last | V first | V mid | V last |", "|---|---|---|---|---|---|---|"]
        for stat in ("pre_mean", "pre_max", "spike"):
            row = [kv["table11"][kvn][w][stat] for kvn in ("K", "V") for w in ("first", "mid", "last")]
            L.append(f"| {stat} | " + " | ".join(_f(x) for x in row) + " |")
        L += ["", "![flip-aligned deviation](kv_flip_aligned.png)", ""]
    t3 = rep["table3_rank_at_flips"]
    L += ["## Table 3: rank of the reference token in the batched logits at flips", "",
          "| batch | flips | top-1 (tie) | top-2 | top-3 | top-8 | max rank |", "|---|---|---|---|---|---|---|"]
    for name, r in [("all", t3["all"]), *t3["per_batch_size"].items()]:
        L.append(f"| {name} | {r['flips']} | {_f(r['top1'], True)} | {_f(r['top2'], True)} | "
                 f"{_f(r['top3'], True)} | {_f(r['top8'], True)} | {_f(r['max_rank'])} |")
    L += ["", "Rank 1 means the batched top-1 is the reference token too: an exact tie (margin 0) "
              "whose argmax fell the other way.", "",
          "## Table 4: near-tie cluster counts C_eps (logits within eps of the batched top-1, top-1 included)", "",
          "| eps | stable | flip | ratio | stable steps | flip steps |", "|---|---|---|---|---|---|"]
    for eps, r in rep["table4_near_tie_counts"].items():
        L.append(f"| {eps} | {_f(r['stable'])} | {_f(r['flip'])} | {_f(r['ratio'])} | {r['stable_steps']} | "
                 f"{r['flip_steps']} |")
    L += ["", "## Table 5: oracle single-column repair", "",
          "The oracle reruns the same batches and, at the fast run's true flip positions, emits the reference "
          "token and writes the reference's K/V column there (each further round also fires at the first "
          "divergence the previous round left).", "",
          "| batch | rounds | runs | flipped runs | repairs/seq. | repairs/flipped seq. | seq. det. (unrepaired) | "
          "seq. det. (oracle) |", "|---|---|---|---|---|---|---|---|"]
    for size, r in rep["table5_oracle_repair"].items():
        L.append(f"| {size} | {r['rounds']} | {r['runs']} | {r['flipped_runs']} | {_f(r['repairs_per_sequence'])} | "
                 f"{_f(r['repairs_per_flipped_sequence'])} | {_f(r['unrepaired_sequence_determinism'], True)} | "
                 f"{_f(r['sequence_determinism'], True)} |")
    m = rep["margins"]
    L += ["", "## Margins (top-1 minus top-2 batched logit) at stable vs flip steps", "",
          "| margin | stable steps | flip steps | flip share |", "|---|---|---|---|"]
    for b in m["bins"]:
        L.append(f"| {b['bin']} | {b['stable']} | {b['flip']} | {_f(b['flip_share'], True)} |")
    L += ["", "Teacher-forced gate (fires at margin < tau or an exact tie): recall of flips and share of "
              "synchronous steps it fires on.", "", "| tau | recall | trigger rate |", "|---|---|---|"]
    for g in m["gate_recall_teacher_forced"]:
        L.append(f"| {g['tau']} | {_f(g['recall'], True)} | {_f(g['trigger_rate'], True)} |")
    d = rep["delta"]
    L += ["", "![margins](margins.png)", "",
          f"Logit perturbation delta (|batched - reference| over the reference's top-{d.get('top_k', DELTA_K)} "
          f"at synchronous steps, {d['samples']} samples): median {_f(d['median'])}, mean {_f(d.get('mean'))}, "
          f"p99 {_f(d.get('p99'))}, max {_f(d['max'])}; exactly equal {_f(d.get('share_exact'), True)}.", "",
          f"Timings (s): {json.dumps(rep['timings_s'])}; total {rep['seconds']} s.", ""]
    return "\n".join(L)


def write_outputs(rep: dict, out: Path, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    (out / "report.md").write_text(markdown(rep))
    if plot:
        from . import plots

        plots.flips_plots(rep, out)


def add_parser(sub, common) -> None:
    p = sub.add_parser("flips", help="flip rates, K/V deviation, ranks, near ties, oracle repair (paper §2)")
    add_run_args(p, common)
    p.add_argument("--batch-sizes", type=common.int_list, default=[4, 8, 16])
    p.add_argument("--homo-sizes", type=_int_list_or_none(common), default=[4],
                   help="homogeneous batch sizes ('none' to skip)")
    p.add_argument("--homo-limit", type=int, default=8, help="prompts replicated in homogeneous batches")
    p.add_argument("--oracle-sizes", type=_int_list_or_none(common), default=[8],
                   help="batch sizes for the oracle repair (Table 5; 'none' to skip)")
    p.add_argument("--oracle-rounds", type=int, default=1)
    p.add_argument("--out", default=None, help="output folder (default results/flips/<dataset>)")
    p.set_defaults(func=cmd_flips, common=common)


def _int_list_or_none(common):
    def parse(text: str):
        return [] if text.strip().lower() in ("none", "") else common.int_list(text)
    return parse


def add_run_args(p, common) -> None:
    p.add_argument("--dataset", default="builtin",
                   help="humaneval, sharegpt, champ, builtin, or a JSON-lines file")
    p.add_argument("--limit", type=int, default=48, help="prompts (a deterministic subset)")
    p.add_argument("--seed", type=int, default=0, help="seed of the subset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=400, help="skip longer prompts")
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: fixed length)")
    p.add_argument("--cache-dir", default=None, help="per-run cache (default: <margingate cache>/runs)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    common.add_model_args(p)


def cache_dir_of(args) -> Path | None:
    if args.no_cache:
        return None
    if args.cache_dir:
        return Path(args.cache_dir)
    from ..models.loader import cache_root

    return cache_root() / "runs"


def cmd_flips(args) -> None:
    cfg = FlipsConfig(args.dataset, args.limit, args.seed, args.batch_sizes, args.homo_sizes, args.homo_limit,
                      args.oracle_sizes, args.oracle_rounds, args.max_new_tokens, args.max_prompt_tokens,
                      not args.respect_eos)
    sizes = [*cfg.batch_sizes, *cfg.homo_sizes, *cfg.oracle_sizes]
    llm = args.common.llm(args, max(sizes))
    rep = run_flips(llm, cfg, cache_dir_of(args), progress=not args.quiet)
    out = Path(args.out or f"results/flips/{Path(args.dataset).stem}")
    write_outputs(rep, out, plot=not args.no_plots)
    a = rep["table1_all_hetero"]
    print(f"{rep['dataset']}: {a['runs']} hetero runs, {a['flips']} flips / {a['synchronous_steps']} sync steps "
          f"= {_f(a['flip_rate'], True)}; wrote {out}/report.md")
