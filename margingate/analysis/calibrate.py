"""`margingate calibrate`: choose a model's tau (paper App. A, §4.3) and save it as its profile.

1. delta: on the calibration prompts, batched (`fast`, heterogeneous batches) vs
   reference logits over the reference's top-k tokens at synchronous steps (same
   prefix); median and max. The sweep grid is built from it (multiples of 2*delta)
   plus the teacher-forced point just above the largest flip margin seen.
2. Sweep tau end to end: `margin` with the `replay` repair and strict=False, so
   no rollback hides a flip the gate let through (with strict=True sequence
   determinism is 100 % at any tau: a missed flip is caught by replay at the
   next trigger or at the end and rolled back, at the cost of recomputation).
   Per tau: sequence determinism, trigger rate, missed flips (= the rollbacks a
   strict run would pay), overhead = (T_margin - T_fast) / T_fast over the same
   batches (both timed in this process unless a run came from the cache).
3. The operating point: the smallest tau with 100 % sequence determinism and
   no missed flip on the calibration set. Saved as the model's profile (the
   engine's default tau), then evaluated, fixed, on the transfer datasets (Table 9).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..policies import FastPolicy, MarginPolicy
from .flips import Runner, _f, batches, cache_dir_of, delta_stats, judge, load_prompts, margins, step_samples
from .flips import add_run_args as _add_run_args


@dataclass
class CalibrateConfig:
    dataset: str = "champ"
    limit: int | None = 48
    seed: int = 0
    batch_sizes: list[int] = field(default_factory=lambda: [8, 16])
    taus: list[float] | None = None
    max_new_tokens: int = 128
    max_prompt_tokens: int = 400
    ignore_eos: bool = True
    transfer: list[str] = field(default_factory=lambda: ["humaneval", "sharegpt"])
    stop_at_first: bool = True
    extra_points: int = 1


def tau_grid(delta: dict, flip_margins: np.ndarray) -> list[float]:
    """Multiples of 2*delta (delta = median |batched - reference|, or its median over the nonzero
    differences when most are exactly 0), up to 2*max delta, plus the point just above the largest
    teacher-forced flip margin (the gate fires at margin < tau)."""
    scale = delta.get("median") or delta.get("median_nonzero") or 0.0625
    base = 2 * scale
    top = max(2 * (delta.get("max") or base), base)
    grid = {round(base * f, 4) for f in (0.25, 0.5, 1, 2, 4, 8, 16, 32) if base * f <= top}
    if len(flip_margins):
        grid.add(round(float(flip_margins.max()) + 0.0625, 4))
    return sorted(g for g in grid if g > 0)


class Sweep:
    def __init__(self, runner: Runner, refs: list[dict], sizes: list[int]):
        self.runner, self.refs, self.sizes = runner, refs, sizes
        self.n = len(runner.ids)

    def fast_seconds(self) -> dict:
        out = {}
        for size in self.sizes:
            run = self.runner.run({"kind": "fast-plain", "size": size}, batches(self.n, size, "hetero"),
                                  lambda i, r: (FastPolicy(), None), f"fast b={size}")
            out[size] = (run["seconds"], run["cached"], run)
        return out

    def margin(self, tau: float, fast: dict) -> dict:
        rows, seconds, t_fast, cached = [], 0.0, 0.0, False
        per_size = {}
        for size in self.sizes:
            run = self.runner.run({"kind": "margin", "size": size, "tau": tau, "repair": "replay",
                                   "strict": False}, batches(self.n, size, "hetero"),
                                  lambda i, r: (MarginPolicy(tau, "replay", "bf16", strict=False), None),
                                  f"margin tau={tau} b={size}")
            j = judge(self.refs, run["rows"])
            per_size[str(size)] = summarise(j, run["seconds"], fast[size][0])
            rows += j
            seconds += run["seconds"]
            t_fast += fast[size][0]
            cached |= run["cached"] or fast[size][1]
        return {"tau": tau, **summarise(rows, seconds, t_fast), "from_cache": cached, "per_batch_size": per_size}


def summarise(judged: list[dict], seconds: float, fast_seconds: float) -> dict:
    n = len(judged)
    tot = lambda k: sum(r["stats"].get(k, 0) for r in judged)  # noqa: E731
    steps = tot("steps")
    ident = sum(r["identical"] for r in judged)
    return {"runs": n, "sequence_determinism": ident / n if n else None,
            "trigger_rate": tot("triggers") / steps if steps else None,
            "repair_rate": tot("repairs") / steps if steps else None,
            "replay_rate": tot("replayed_tokens") / steps if steps else None,
            "missed_flips": tot("missed_flips"), "runs_with_missed_flips": sum(
                1 for r in judged if r["stats"].get("missed_flips")),
            "decode_steps": steps, "seconds": round(seconds, 2), "fast_seconds": round(fast_seconds, 2),
            "overhead": (seconds - fast_seconds) / fast_seconds if fast_seconds else None}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "machine": platform.machine(), "torch": torch.__version__}
    for pkg in ("margingate", "numpy", "transformers", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def run_calibrate(llm, cfg: CalibrateConfig, cache_dir: Path | None, progress: bool = True,
                  profile_dir: Path | None = None, save: bool = True) -> dict:
    t0 = time.perf_counter()
    prompts = load_prompts(llm, cfg.dataset, cfg.limit, cfg.seed, cfg.max_prompt_tokens)
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    runner = Runner(llm, ids, cfg.max_new_tokens, ignore_eos=cfg.ignore_eos, cache_dir=cache_dir,
                    progress=progress, tag=f"{cfg.dataset}: ")
    refs = runner.reference()
    judged = []
    for size in cfg.batch_sizes:
        judged += judge(refs, runner.fast(refs, "hetero", size)["rows"])
    delta = delta_stats(judged, refs)
    flip_m = margins(step_samples(judged, refs)["flip"])
    flips = sum(not r["identical"] for r in judged)
    sync = sum(r["sync"] for r in judged)
    taus = sorted(set(cfg.taus)) if cfg.taus else tau_grid(delta, flip_m)
    sweep = Sweep(runner, refs, cfg.batch_sizes)
    fast = sweep.fast_seconds()
    frontier, chosen, extra = [], None, 0
    for tau in taus:
        row = sweep.margin(tau, fast)
        frontier.append(row)
        if chosen is None and row["sequence_determinism"] == 1.0 and row["missed_flips"] == 0:
            chosen = tau
        elif chosen is not None:
            extra += 1
        if chosen is not None and cfg.stop_at_first and extra >= cfg.extra_points:
            break
    rep = {"command": "calibrate", "dataset": cfg.dataset,
           "settings": {k: v for k, v in vars(cfg).items()} | {"prompts": len(prompts)},
           "prompt_sources": [p.source for p in prompts], "environment": llm.environment(),
           "delta": delta, "perturbation_tau": 2 * (delta.get("median") or delta.get("median_nonzero") or 0.0),
           "fast_flips": {"runs": len(judged), "flips": flips, "synchronous_steps": sync,
                          "flip_rate": flips / sync if sync else None,
                          "max_flip_margin": float(flip_m.max()) if len(flip_m) else None},
           "taus": taus, "table7_frontier": frontier, "tau": chosen,
           "criterion": "smallest tau with 100 % sequence determinism and no missed flip (strict=False, "
                        "replay repair) on every heterogeneous batch size of the calibration set"}
    if chosen is None:
        rep["warning"] = "no tau in the sweep reached 100 % sequence determinism without missed flips"
    if chosen is not None and save:
        from ..profiles import save_profile

        point = next(r for r in frontier if r["tau"] == chosen)
        profile = {"tau": chosen, "delta": {k: delta.get(k) for k in ("median", "median_nonzero", "max", "top_k")},
                   "dataset": cfg.dataset, "prompts": len(prompts), "seed": cfg.seed,
                   "batch_sizes": cfg.batch_sizes, "max_new_tokens": cfg.max_new_tokens,
                   "criterion": rep["criterion"], "trigger_rate": point["trigger_rate"],
                   "overhead": point["overhead"], "date": _dt.date.today().isoformat(),
                   "threads": llm.engine.num_threads, "device": str(llm.model.device), "versions": versions()}
        rep["profile_path"] = str(save_profile(llm.config, profile, profile_dir))
        rep["profile"] = profile
    rep["table9_transfer"] = {}
    if chosen is not None:
        cal = next(r for r in frontier if r["tau"] == chosen)
        rep["table9_transfer"][cfg.dataset] = {"calibration": True, **{k: v for k, v in cal.items()
                                                                         if k != "per_batch_size"}}
        for name in cfg.transfer:
            rep["table9_transfer"][name] = transfer(llm, cfg, name, chosen, cache_dir, progress)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    return rep


def transfer(llm, cfg: CalibrateConfig, name: str, tau: float, cache_dir, progress) -> dict:
    prompts = load_prompts(llm, name, cfg.limit, cfg.seed, cfg.max_prompt_tokens)
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    runner = Runner(llm, ids, cfg.max_new_tokens, ignore_eos=cfg.ignore_eos, cache_dir=cache_dir,
                    progress=progress, tag=f"{name}: ")
    refs = runner.reference()
    sweep = Sweep(runner, refs, cfg.batch_sizes)
    row = sweep.margin(tau, sweep.fast_seconds())
    return {"calibration": False, "prompts": len(prompts), **row}


# --- report ---------------------------------------------------------------------------

def markdown(rep: dict) -> str:
    s, d = rep["settings"], rep["delta"]
    env = rep["environment"]
    L = [f"# Calibration: {env['model']} on {rep['dataset']}", "",
         f"{s['prompts']} prompts (seed {s['seed']}), {s['max_new_tokens']} new tokens"
         f"{' (EOS ignored)' if s['ignore_eos'] else ''}, heterogeneous batches of {s['batch_sizes']}; "
         f"torch {env['torch']}, {env['num_threads']} threads, {env['device']}.", "",
         "## App. A: perturbation scale and threshold", "",
         "| delta med. | delta med. (nonzero) | delta max | pert. (2 x delta) | emp. tau |", "|---|---|---|---|---|",
         f"| {_f(d.get('median'))} | {_f(d.get('median_nonzero'))} | {_f(d.get('max'))} | "
         f"{_f(rep.get('perturbation_tau'))} | {_f(rep.get('tau'))} |", "",
         f"delta = |batched - reference| over the reference's top-{d.get('top_k')} logits at synchronous steps "
         f"({d.get('samples')} samples; {_f(d.get('share_exact'), True)} exactly equal; pert. uses the median, "
         f"or the median of the nonzero differences when most are exactly equal). "
         f"Fast path: {rep['fast_flips']['flips']} flips in {rep['fast_flips']['synchronous_steps']} synchronous "
         f"steps ({_f(rep['fast_flips']['flip_rate'], True)}), largest flip margin "
         f"{_f(rep['fast_flips']['max_flip_margin'])}.", "",
         "## Table 7: threshold frontier (margin, replay repair, strict=False)", "",
         "| tau | seq. det. | trigger rate | repair rate | replayed/step | missed flips (= strict rollbacks) | "
         "time s | fast s | overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["table7_frontier"]:
        L.append(f"| {r['tau']} | {_f(r['sequence_determinism'], True)} | {_f(r['trigger_rate'], True)} | "
                 f"{_f(r['repair_rate'], True)} | {_f(r['replay_rate'])} | {r['missed_flips']} | {r['seconds']} | "
                 f"{r['fast_seconds']} | {_f(r['overhead'], True)}{' (cached)' if r['from_cache'] else ''} |")
    L += ["", f"Criterion: {rep['criterion']}. Chosen tau: **{rep.get('tau')}**"
              + (f"; profile: `{rep['profile_path']}`" if rep.get("profile_path") else ""), "",
          "![frontier](frontier.png)", "",
          "## Table 9: transfer at the fixed tau", "",
          "| dataset | prompts/runs | BF16 (fast) s | MarginGate s | overhead | trigger rate | seq. det. | "
          "missed flips |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rep["table9_transfer"].items():
        L.append(f"| {name}{' (calibration)' if r.get('calibration') else ''} | {r['runs']} | {r['fast_seconds']} | "
                 f"{r['seconds']} | {_f(r['overhead'], True)} | {_f(r['trigger_rate'], True)} | "
                 f"{_f(r['sequence_determinism'], True)} | {r['missed_flips']} |")
    L += ["", "Overheads compare runs of the same batches in one process; rows marked cached reuse "
              "timings from the run that produced the cache entry. On this CPU the verifier is a separate "
              "pass of per-row attention; every row of every batch is protected.", "",
          f"Total {rep['seconds']} s.", ""]
    return "\n".join(L)


def write_outputs(rep: dict, out: Path, plot: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    (out / "report.md").write_text(markdown(rep))
    if plot and rep["table7_frontier"]:
        from . import plots

        plots.frontier_plot(rep, out)


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not math.isfinite(v) or v < 0 for v in vals):
        raise ValueError(f"expected finite numbers >= 0, got {text!r}")
    return vals


def add_parser(sub, common) -> None:
    p = sub.add_parser("calibrate", help="estimate delta, sweep tau, save the model's profile (paper App. A)")
    _add_run_args(p, common)
    p.set_defaults(dataset="champ")
    p.add_argument("--batch-sizes", type=common.int_list, default=[8, 16])
    p.add_argument("--taus", default=None, help="comma-separated taus (default: a grid built from delta)")
    p.add_argument("--transfer", default="humaneval,sharegpt", help="datasets for Table 9 ('none' to skip)")
    p.add_argument("--full-sweep", action="store_true",
                   help="sweep every tau (default: stop one point after the first deterministic tau)")
    p.add_argument("--profile-dir", default=None,
                   help="where to save the profile (default: the user profile folder the engine reads)")
    p.add_argument("--no-save", action="store_true", help="do not save a profile")
    p.add_argument("--out", default=None, help="output folder (default results/calibrate/<dataset>)")
    p.set_defaults(func=cmd_calibrate, common=common)


def cmd_calibrate(args) -> None:
    transfer_sets = [] if args.transfer.strip().lower() in ("", "none") else [
        t.strip() for t in args.transfer.split(",") if t.strip()]
    cfg = CalibrateConfig(args.dataset, args.limit, args.seed, args.batch_sizes,
                          _floats(args.taus) if args.taus else None, args.max_new_tokens, args.max_prompt_tokens,
                          not args.respect_eos, transfer_sets, not args.full_sweep)
    llm = args.common.llm(args, max(cfg.batch_sizes))
    rep = run_calibrate(llm, cfg, cache_dir_of(args), progress=not args.quiet,
                        profile_dir=Path(args.profile_dir) if args.profile_dir else None, save=not args.no_save)
    out = Path(args.out or f"results/calibrate/{Path(args.dataset).stem}")
    write_outputs(rep, out, plot=not args.no_plots)
    print(f"tau = {rep.get('tau')} (delta median {_f(rep['delta'].get('median'))}, max "
          f"{_f(rep['delta'].get('max'))}); wrote {out}/report.md"
          + (f"; profile {rep['profile_path']}" if rep.get("profile_path") else ""))
