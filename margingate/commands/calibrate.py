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
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import cli_args
from ..analysis import plots
from ..analysis.compare import flip_rates, judge, overhead, reference_tokens, summary
from ..analysis.diagnostics import delta_stats, margins, step_samples
from ..analysis.outputs import fmt, write_report
from ..analysis.runs import add_run_args, batches, cache_dir_of, load_prompts
from ..environment import versions
from ..options import PolicySpec

if TYPE_CHECKING:
    from ..analysis.traces import TraceRunner

FAST = PolicySpec("fast")
#: the margin policy swept: replay repair, strict=False (a flip the gate misses is counted, not hidden)
SWEPT = PolicySpec("margin", repair="replay", verifier_precision="bf16", strict=False)
#: what a margin run reports (Table 7, Table 9), from the judged runs
MARGIN_KEYS = ("runs", "sequence_determinism", "trigger_rate", "repair_rate", "replay_rate", "missed_flips",
               "runs_with_missed_flips", "decode_steps")


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
    """`margin` at one tau over the calibration batches, timed against `fast` on the same batches."""

    def __init__(self, runner: TraceRunner, refs: list[dict], sizes: list[int]):
        self.runner, self.sizes = runner, sizes
        self.references = reference_tokens(refs)
        self.n = len(runner.ids)

    def fast_seconds(self) -> dict:
        out = {}
        for size in self.sizes:
            run = self.runner.run({"kind": "fast-plain", "size": size}, batches(self.n, size, "hetero"),
                                  lambda i, r: (self.runner.llm.policy(FAST), None), f"fast b={size}")
            out[size] = (run["seconds"], run["cached"], run)
        return out

    def margin(self, tau: float, fast: dict) -> dict:
        spec = SWEPT.replace(tau=tau)
        rows, seconds, t_fast, cached = [], 0.0, 0.0, False
        per_size = {}
        for size in self.sizes:
            # the run's cache key (unchanged since runs were keyed by hand)
            key = {"kind": "margin", "size": size, "tau": tau, "repair": spec.repair, "strict": spec.strict}
            run = self.runner.run(key, batches(self.n, size, "hetero"),
                                  lambda i, r: (self.runner.llm.policy(spec), None), f"margin tau={tau} b={size}")
            j = judge(self.references, run["rows"])
            per_size[str(size)] = summarise(j, run["seconds"], fast[size][0])
            rows += j
            seconds += run["seconds"]
            t_fast += fast[size][0]
            cached |= run["cached"] or fast[size][1]
        return {"tau": tau, **summarise(rows, seconds, t_fast), "from_cache": cached, "per_batch_size": per_size}


def summarise(judged: list[dict], seconds: float, fast_seconds: float) -> dict:
    return {**summary(judged, MARGIN_KEYS), "seconds": round(seconds, 2), "fast_seconds": round(fast_seconds, 2),
            "overhead": overhead(seconds, fast_seconds)}


def traced_references(llm, cfg: CalibrateConfig, dataset: str, cache_dir, progress) -> tuple:
    """The dataset's prompts, a runner over them and their traced references."""
    from ..analysis.traces import TraceRunner  # its policies load torch: only when a command runs

    prompts = load_prompts(llm, dataset, cfg.limit, cfg.seed, cfg.max_prompt_tokens)
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    runner = TraceRunner(llm, ids, cfg.max_new_tokens, ignore_eos=cfg.ignore_eos, cache_dir=cache_dir,
                         progress=progress, tag=f"{dataset}: ")
    return prompts, runner, runner.reference()


CRITERION = ("smallest tau with 100 % sequence determinism and no missed flip (strict=False, "
             "replay repair) on every heterogeneous batch size of the calibration set")


def run_calibrate(llm, cfg: CalibrateConfig, cache_dir: Path | None, progress: bool = True,
                  profile_dir: Path | None = None, save: bool = True) -> dict:
    t0 = time.perf_counter()
    prompts, runner, refs = traced_references(llm, cfg, cfg.dataset, cache_dir, progress)
    judged = []
    for size in cfg.batch_sizes:
        judged += judge(reference_tokens(refs), runner.fast(refs, "hetero", size)["rows"])
    delta = delta_stats(judged, refs)
    flip_m = margins(step_samples(judged, refs)["flip"])
    taus = sorted(set(cfg.taus)) if cfg.taus else tau_grid(delta, flip_m)
    frontier, chosen = sweep(Sweep(runner, refs, cfg.batch_sizes), taus, cfg)
    fast_flips = {k: v for k, v in flip_rates(judged).items() if k in ("runs", "flips", "synchronous_steps",
                                                                        "flip_rate")}
    rep = {"command": "calibrate", "dataset": cfg.dataset,
           "settings": {k: v for k, v in vars(cfg).items()} | {"prompts": len(prompts)},
           "prompt_sources": [p.source for p in prompts], "environment": llm.environment(),
           "delta": delta, "perturbation_tau": 2 * (delta.get("median") or delta.get("median_nonzero") or 0.0),
           "fast_flips": fast_flips | {"max_flip_margin": float(flip_m.max()) if len(flip_m) else None},
           "taus": taus, "table7_frontier": frontier, "tau": chosen, "criterion": CRITERION}
    if chosen is None:
        rep["warning"] = "no tau in the sweep reached 100 % sequence determinism without missed flips"
    if chosen is not None and save:
        from ..profiles import save_profile

        prof = profile_at(llm, cfg, delta, next(r for r in frontier if r["tau"] == chosen), len(prompts))
        rep["profile_path"] = str(save_profile(llm.config, prof, profile_dir))
        rep["profile"] = prof
    rep["table9_transfer"] = {}
    if chosen is not None:
        cal = next(r for r in frontier if r["tau"] == chosen)
        rep["table9_transfer"][cfg.dataset] = {"calibration": True, **{k: v for k, v in cal.items()
                                                                         if k != "per_batch_size"}}
        for name in cfg.transfer:
            rep["table9_transfer"][name] = transfer(llm, cfg, name, chosen, cache_dir, progress)
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    return rep


def sweep(s: Sweep, taus: list[float], cfg: CalibrateConfig) -> tuple[list[dict], float | None]:
    """The frontier over `taus` and the chosen tau (None if none qualifies); with `stop_at_first`,
    stops `extra_points` taus after the first that qualifies."""
    fast = s.fast_seconds()
    frontier, chosen, extra = [], None, 0
    for tau in taus:
        row = s.margin(tau, fast)
        frontier.append(row)
        if chosen is None and row["sequence_determinism"] == 1.0 and row["missed_flips"] == 0:
            chosen = tau
        elif chosen is not None:
            extra += 1
        if chosen is not None and cfg.stop_at_first and extra >= cfg.extra_points:
            break
    return frontier, chosen


def profile_at(llm, cfg: CalibrateConfig, delta: dict, point: dict, prompts: int) -> dict:
    """The model profile saved at the chosen operating point (the engine's default tau)."""
    env = llm.environment()
    return {"tau": point["tau"], "delta": {k: delta.get(k) for k in ("median", "median_nonzero", "max", "top_k")},
            "dataset": cfg.dataset, "prompts": prompts, "seed": cfg.seed,
            "batch_sizes": cfg.batch_sizes, "max_new_tokens": cfg.max_new_tokens,
            "criterion": CRITERION, "trigger_rate": point["trigger_rate"],
            "overhead": point["overhead"], "date": _dt.date.today().isoformat(),
            "threads": env["num_threads"], "device": env["device"], "versions": versions(env)}


def transfer(llm, cfg: CalibrateConfig, name: str, tau: float, cache_dir, progress) -> dict:
    prompts, runner, refs = traced_references(llm, cfg, name, cache_dir, progress)
    s = Sweep(runner, refs, cfg.batch_sizes)
    row = s.margin(tau, s.fast_seconds())
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
         f"| {fmt(d.get('median'))} | {fmt(d.get('median_nonzero'))} | {fmt(d.get('max'))} | "
         f"{fmt(rep.get('perturbation_tau'))} | {fmt(rep.get('tau'))} |", "",
         f"delta = |batched - reference| over the reference's top-{d.get('top_k')} logits at synchronous steps "
         f"({d.get('samples')} samples; {fmt(d.get('share_exact'), True)} exactly equal; pert. uses the median, "
         f"or the median of the nonzero differences when most are exactly equal). "
         f"Fast path: {rep['fast_flips']['flips']} flips in {rep['fast_flips']['synchronous_steps']} synchronous "
         f"steps ({fmt(rep['fast_flips']['flip_rate'], True)}), largest flip margin "
         f"{fmt(rep['fast_flips']['max_flip_margin'])}.", "",
         "## Table 7: threshold frontier (margin, replay repair, strict=False)", "",
         "| tau | seq. det. | trigger rate | repair rate | replayed/step | missed flips (= strict rollbacks) | "
         "time s | fast s | overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["table7_frontier"]:
        L.append(f"| {r['tau']} | {fmt(r['sequence_determinism'], True)} | {fmt(r['trigger_rate'], True)} | "
                 f"{fmt(r['repair_rate'], True)} | {fmt(r['replay_rate'])} | {r['missed_flips']} | {r['seconds']} | "
                 f"{r['fast_seconds']} | {fmt(r['overhead'], True)}{' (cached)' if r['from_cache'] else ''} |")
    L += ["", f"Criterion: {rep['criterion']}. Chosen tau: **{rep.get('tau')}**"
              + (f"; profile: `{rep['profile_path']}`" if rep.get("profile_path") else ""), "",
          "![frontier](frontier.png)", "",
          "## Table 9: transfer at the fixed tau", "",
          "| dataset | prompts/runs | BF16 (fast) s | MarginGate s | overhead | trigger rate | seq. det. | "
          "missed flips |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rep["table9_transfer"].items():
        L.append(f"| {name}{' (calibration)' if r.get('calibration') else ''} | {r['runs']} | {r['fast_seconds']} | "
                 f"{r['seconds']} | {fmt(r['overhead'], True)} | {fmt(r['trigger_rate'], True)} | "
                 f"{fmt(r['sequence_determinism'], True)} | {r['missed_flips']} |")
    L += ["", "Overheads compare runs of the same batches in one process; rows marked cached reuse "
              "timings from the run that produced the cache entry. On this CPU the verifier is a separate "
              "pass of per-row attention; every row of every batch is protected.", "",
          f"Total {rep['seconds']} s.", ""]
    return "\n".join(L)


def write_outputs(rep: dict, out: Path, plot: bool = True) -> None:
    write_report(rep, out, markdown, _frontier_plot if plot and rep["table7_frontier"] else None)


def _frontier_plot(rep: dict, out: Path) -> list[Path]:
    return [plots.frontier_plot(rep, out)]


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not math.isfinite(v) or v < 0 for v in vals):
        raise ValueError(f"expected finite numbers >= 0, got {text!r}")
    return vals


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="estimate delta, sweep tau, save the model's profile (paper App. A)")
    add_run_args(p)
    p.set_defaults(dataset="champ")
    p.add_argument("--batch-sizes", type=cli_args.int_list, default=[8, 16])
    p.add_argument("--taus", default=None, help="comma-separated taus (default: a grid built from delta)")
    p.add_argument("--transfer", default="humaneval,sharegpt", help="datasets for Table 9 ('none' to skip)")
    p.add_argument("--full-sweep", action="store_true",
                   help="sweep every tau (default: stop one point after the first deterministic tau)")
    p.add_argument("--profile-dir", default=None,
                   help="where to save the profile (default: the user profile folder the engine reads)")
    p.add_argument("--no-save", action="store_true", help="do not save a profile")
    p.add_argument("--out", default=None, help="output folder (default results/calibrate/<dataset>)")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> None:
    transfer_sets = [] if args.transfer.strip().lower() in ("", "none") else [
        t.strip() for t in args.transfer.split(",") if t.strip()]
    cfg = CalibrateConfig(args.dataset, args.limit, args.seed, args.batch_sizes,
                          _floats(args.taus) if args.taus else None, args.max_new_tokens, args.max_prompt_tokens,
                          not args.respect_eos, transfer_sets, not args.full_sweep)
    llm = cli_args.llm(args, max(cfg.batch_sizes))
    rep = run_calibrate(llm, cfg, cache_dir_of(args), progress=not args.quiet,
                        profile_dir=Path(args.profile_dir) if args.profile_dir else None, save=not args.no_save)
    out = Path(args.out or f"results/calibrate/{Path(args.dataset).stem}")
    write_outputs(rep, out, plot=not args.no_plots)
    print(f"tau = {rep.get('tau')} (delta median {fmt(rep['delta'].get('median'))}, max "
          f"{fmt(rep['delta'].get('max'))}); wrote {out}/report.md"
          + (f"; profile {rep['profile_path']}" if rep.get("profile_path") else ""))
