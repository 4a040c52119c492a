"""`margingate flips`: the paper's observations (§2, App. B-C) measured on our engine.

Every prompt is decoded by the `reference` policy (the verifier's kernels, batched:
bitwise what decoding alone computes), then by `fast` inside heterogeneous batches
(consecutive prompts of the shuffled set) and homogeneous batches (one prompt
replicated) of each size; every run is traced (traces.py) and cached on disk (runs.py),
so a re-run with the same settings reuses finished work. The diagnostics computed from
the traces (diagnostics.py) fill the paper's tables: flip rates (Table 1), K/V deviation
around the first flip (Table 2, Fig. 1, Table 11), the reference token's rank at flips
(Table 3), near-tie counts (Table 4), margins and the teacher-forced gate, the logit
perturbation delta. The oracle single-column repair (Table 5) reruns the batches that
flipped, firing at the known flips.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import cli_args
from ..analysis import plots
from ..analysis.compare import flip_rates, judge, reference_tokens
from ..analysis.diagnostics import (
    DELTA_K,
    aligned_deviation,
    delta_stats,
    gate_recall,
    margin_bins,
    margins,
    near_tie_counts,
    rank_table,
    repaired_deviation,
    step_samples,
)
from ..analysis.outputs import fmt, write_report
from ..analysis.runs import add_run_args, cache_dir_of, load_prompts

if TYPE_CHECKING:
    from ..analysis.traces import TraceRunner


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


def run_flips(llm, cfg: FlipsConfig, cache_dir: Path | None, progress: bool = True) -> dict:
    from ..analysis.traces import TraceRunner  # its policies load torch: only when a command runs

    t0 = time.perf_counter()
    prompts = load_prompts(llm, cfg.dataset, cfg.limit, cfg.seed, cfg.max_prompt_tokens)
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    runner = TraceRunner(llm, ids, cfg.max_new_tokens, ignore_eos=cfg.ignore_eos, cache_dir=cache_dir,
                         progress=progress, tag=f"{cfg.dataset}: ")
    refs = runner.reference()
    judged_all, timings = _fast_runs(runner, refs, cfg)
    table1: dict = {"hetero": {}, "homo": {}}
    for (mode, size), judged in judged_all.items():
        table1[mode][str(size)] = flip_rates(judged)
    hetero = [r for (mode, _), js in judged_all.items() if mode == "hetero" for r in js]
    samples = step_samples(hetero, refs)
    per_size = {str(s): rank_table(step_samples(judged_all[("hetero", s)], refs)["ranks"])
                for s in cfg.batch_sizes}
    oracle = {}
    for size in cfg.oracle_sizes:
        judged = judged_all.get(("hetero", size)) or judge(reference_tokens(refs),
                                                           runner.fast(refs, "hetero", size)["rows"])
        oracle[str(size)] = run_oracle(runner, refs, judged, size, cfg.oracle_rounds)
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


def _fast_runs(runner: TraceRunner, refs: list[dict], cfg: FlipsConfig) -> tuple[dict, dict]:
    """`fast` in heterogeneous then homogeneous batches of each size, judged: {(mode, size): judged
    runs} and the seconds each took."""
    judged_all, timings = {}, {}
    for mode, sizes in (("hetero", cfg.batch_sizes), ("homo", cfg.homo_sizes)):
        for size in sizes:
            run = runner.fast(refs, mode, size, cfg.homo_limit if mode == "homo" else None)
            judged_all[(mode, size)] = judge(reference_tokens(refs), run["rows"])
            timings[f"fast_{mode}_{size}"] = round(run["seconds"], 2)
    return judged_all, timings


def run_oracle(runner: TraceRunner, refs: list[dict], judged: list[dict], size: int, rounds: int) -> dict:
    """Fire at the fast run's true flip positions; each further round also fires at the first
    divergence the previous round left (a flip at an identical prefix, so a true flip)."""
    fire = {r["prompt"]: {r["d"]} for r in judged if r["d"] is not None}
    flipped = set(fire)
    final: dict[int, dict] = {}
    n_runs = len(judged)
    for rnd in range(1, rounds + 1):
        run = runner.oracle(refs, size, fire, rnd)
        result_rows = judge(reference_tokens(refs), run["rows"])
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
            "repaired_dev_last_layer": repaired_deviation(list(final.values())),
            "fires_where_batched_differed": repairs,
            "note": "a fire where the batched argmax equalled the reference means the rerun did not "
                    "reproduce the flip"}


# --- report ----------------------------------------------------------------------------

def markdown(rep: dict) -> str:
    return "\n".join([*_md_intro(rep), *_md_flip_rates(rep), *_md_kv_deviation(rep["table2_table11_kv_deviation"]),
                      *_md_ranks_and_ties(rep), *_md_oracle(rep["table5_oracle_repair"]), *_md_margins(rep)])


def _md_intro(rep: dict) -> list[str]:
    s, env = rep["settings"], rep["environment"]
    L = [f"# Flip measurements: {rep['dataset']}",
         "",
         f"{s['prompts']} prompts (seed {s['seed']}, prompt tokens {rep['prompt_tokens']['min']}-"
         f"{rep['prompt_tokens']['max']}), {s['max_new_tokens']} new tokens"
         f"{' (EOS ignored)' if s['ignore_eos'] else ''}; model {env['model']} ({env['model_fingerprint']}), "
         f"torch {env['torch']}, {env['num_threads']} threads, {env['device']}. "
         "Reference = the `reference` policy (decoding alone); batched = `fast`.", ""]
    if rep.get("partial"):
        L += [f"**Partial report:** {rep['partial']}.", ""]
    return L


def _md_flip_rates(rep: dict) -> list[str]:
    def row(mode, size, r):
        return (f"| {mode} | {size} | {r['runs']} | {r['flips']} | {r['synchronous_steps']} | "
                f"{fmt(r['flip_rate'], True)} | {fmt(r['sequence_determinism'], True)} | "
                f"{fmt(r['median_first_flip'])} |")

    L = ["## Table 1 / App. C: synchronous flip rate", "",
         "| mode | batch | runs | flips | sync. steps | flip rate | seq. det. | median first flip |",
         "|---|---|---|---|---|---|---|---|"]
    L += [row(mode, size, r) for mode, per in rep["table1_flip_rate"].items() for size, r in per.items()]
    return L + [row("hetero", "all", rep["table1_all_hetero"]), "",
                "Homogeneous batches replicate one prompt (no padding); on this CPU they are bitwise equal to "
                "decoding alone, so their flip rate is 0 by construction of the kernels, not by luck.", ""]


def _md_kv_deviation(kv: dict) -> list[str]:
    if not kv.get("trials"):
        return []
    t2 = kv["table2"]
    L = [f"## Table 2 / Fig. 1: K/V deviation aligned to the first flip (last layer L{kv['last_layer']}, "
         f"{kv['trials']} trials)", "",
         "max |batched - reference| over heads x dims of the column of output token j, at j - d "
         "(d = first flip). pre = mean over j < d (identical tokens), spike = j = d.", "",
         "| K pre | K spike | K ratio | V pre | V spike | V ratio | median pre-flip K slope /token |",
         "|---|---|---|---|---|---|---|",
         f"| {fmt(t2['K']['pre'])} | {fmt(t2['K']['spike'])} | {fmt(t2['K']['ratio'])} | {fmt(t2['V']['pre'])} | "
         f"{fmt(t2['V']['spike'])} | {fmt(t2['V']['ratio'])} | {fmt(kv['pre_flip_slope_last_layer_K']['median'])} |",
         "", "## Table 11: per-layer K/V error (first / middle / last layer)", "",
         "| | K first | K mid | K last | V first | V mid | V last |", "|---|---|---|---|---|---|---|"]
    for stat in ("pre_mean", "pre_max", "spike"):
        row = [kv["table11"][kvn][w][stat] for kvn in ("K", "V") for w in ("first", "mid", "last")]
        L.append(f"| {stat} | " + " | ".join(fmt(x) for x in row) + " |")
    return L + ["", "![flip-aligned deviation](kv_flip_aligned.png)", ""]


def _md_ranks_and_ties(rep: dict) -> list[str]:
    t3 = rep["table3_rank_at_flips"]
    L = ["## Table 3: rank of the reference token in the batched logits at flips", "",
         "| batch | flips | top-1 (tie) | top-2 | top-3 | top-8 | max rank |", "|---|---|---|---|---|---|---|"]
    for name, r in [("all", t3["all"]), *t3["per_batch_size"].items()]:
        L.append(f"| {name} | {r['flips']} | {fmt(r['top1'], True)} | {fmt(r['top2'], True)} | "
                 f"{fmt(r['top3'], True)} | {fmt(r['top8'], True)} | {fmt(r['max_rank'])} |")
    L += ["", "Rank 1 means the batched top-1 is the reference token too: an exact tie (margin 0) "
              "whose argmax fell the other way.", "",
          "## Table 4: near-tie cluster counts C_eps (logits within eps of the batched top-1, top-1 included)", "",
          "| eps | stable | flip | ratio | stable steps | flip steps |", "|---|---|---|---|---|---|"]
    for eps, r in rep["table4_near_tie_counts"].items():
        L.append(f"| {eps} | {fmt(r['stable'])} | {fmt(r['flip'])} | {fmt(r['ratio'])} | {r['stable_steps']} | "
                 f"{r['flip_steps']} |")
    return L


def _md_oracle(table5: dict) -> list[str]:
    L = ["", "## Table 5: oracle single-column repair", "",
         "The oracle reruns the same batches and, at the fast run's true flip positions, emits the reference "
         "token and writes the reference's K/V column there (each further round also fires at the first "
         "divergence the previous round left).", "",
         "| batch | rounds | runs | flipped runs | repairs/seq. | repairs/flipped seq. | seq. det. (unrepaired) | "
         "seq. det. (oracle) |", "|---|---|---|---|---|---|---|---|"]
    for size, r in table5.items():
        L.append(f"| {size} | {r['rounds']} | {r['runs']} | {r['flipped_runs']} | {fmt(r['repairs_per_sequence'])} | "
                 f"{fmt(r['repairs_per_flipped_sequence'])} | {fmt(r['unrepaired_sequence_determinism'], True)} | "
                 f"{fmt(r['sequence_determinism'], True)} |")
    return L


def _md_margins(rep: dict) -> list[str]:
    m, d = rep["margins"], rep["delta"]
    L = ["", "## Margins (top-1 minus top-2 batched logit) at stable vs flip steps", "",
         "| margin | stable steps | flip steps | flip share |", "|---|---|---|---|"]
    L += [f"| {b['bin']} | {b['stable']} | {b['flip']} | {fmt(b['flip_share'], True)} |" for b in m["bins"]]
    L += ["", "Teacher-forced gate (fires at margin < tau or an exact tie): recall of flips and share of "
              "synchronous steps it fires on.", "", "| tau | recall | trigger rate |", "|---|---|---|"]
    L += [f"| {g['tau']} | {fmt(g['recall'], True)} | {fmt(g['trigger_rate'], True)} |"
          for g in m["gate_recall_teacher_forced"]]
    return L + ["", "![margins](margins.png)", "",
                f"Logit perturbation delta (|batched - reference| over the reference's top-"
                f"{d.get('top_k', DELTA_K)} at synchronous steps, {d['samples']} samples): median "
                f"{fmt(d['median'])}, mean {fmt(d.get('mean'))}, p99 {fmt(d.get('p99'))}, max {fmt(d['max'])}; "
                f"exactly equal {fmt(d.get('share_exact'), True)}.", "",
                f"Timings (s): {json.dumps(rep['timings_s'])}; total {rep['seconds']} s.", ""]


def write_outputs(rep: dict, out: Path, plot: bool = True) -> None:
    write_report(rep, out, markdown, plots.flips_plots if plot else None)


# --- the command -----------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("flips", help="flip rates, K/V deviation, ranks, near ties, oracle repair (paper §2)")
    add_run_args(p)
    p.add_argument("--batch-sizes", type=cli_args.int_list, default=[4, 8, 16])
    p.add_argument("--homo-sizes", type=cli_args.int_list_or_none, default=[4],
                   help="homogeneous batch sizes ('none' to skip)")
    p.add_argument("--homo-limit", type=int, default=8, help="prompts replicated in homogeneous batches")
    p.add_argument("--oracle-sizes", type=cli_args.int_list_or_none, default=[8],
                   help="batch sizes for the oracle repair (Table 5; 'none' to skip)")
    p.add_argument("--oracle-rounds", type=int, default=1)
    p.add_argument("--out", default=None, help="output folder (default results/flips/<dataset>)")
    p.set_defaults(func=cmd_flips)


def cmd_flips(args) -> None:
    cfg = FlipsConfig(args.dataset, args.limit, args.seed, args.batch_sizes, args.homo_sizes, args.homo_limit,
                      args.oracle_sizes, args.oracle_rounds, args.max_new_tokens, args.max_prompt_tokens,
                      not args.respect_eos)
    sizes = [*cfg.batch_sizes, *cfg.homo_sizes, *cfg.oracle_sizes]
    llm = cli_args.llm(args, max(sizes))
    rep = run_flips(llm, cfg, cache_dir_of(args), progress=not args.quiet)
    out = Path(args.out or f"results/flips/{Path(args.dataset).stem}")
    write_outputs(rep, out, plot=not args.no_plots)
    a = rep["table1_all_hetero"]
    print(f"{rep['dataset']}: {a['runs']} hetero runs, {a['flips']} flips / {a['synchronous_steps']} sync steps "
          f"= {fmt(a['flip_rate'], True)}; wrote {out}/report.md")
