"""Are several lm_eval runs of the same tasks bitwise the same? Per item and per score.

    .venv/bin/python scripts/compare_lm_eval.py results/lm-eval/run1 results/lm-eval/run2 results/lm-eval/run3 \
        --out results/lm-eval/summary.json

Each run folder is an lm_eval `--output_path` written with `--log_samples`: one results_*.json and one
samples_<task>_*.jsonl per task (under a folder named after the model). lm_eval writes each response with
str(), so a loglikelihood is the shortest repr of its float64: equal strings are equal bits. For every task,
every item's `resps` and `filtered_resps` (loglikelihood and is_greedy per choice, or the generated text) must
be identical across runs, and so must every score in results_*.json. Prints a table, writes the summary, and
exits 1 on any difference.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def latest(folder: Path, pattern: str) -> list[Path]:
    """The files matching `pattern` under `folder`; lm_eval's timestamped names sort by time."""
    return sorted(folder.rglob(pattern))


def load_run(folder: Path) -> tuple[dict, dict]:
    """(scores by task, {task: {doc_id: sample}}) of one run folder."""
    results = latest(folder, "results_*.json")
    if not results:
        sys.exit(f"compare_lm_eval: no results_*.json under {folder}")
    scores = json.loads(results[-1].read_text())["results"]
    samples = {}
    for task in scores:
        files = latest(folder, f"samples_{task}_*.jsonl")
        if not files:
            sys.exit(f"compare_lm_eval: no samples_{task}_*.jsonl under {folder} (run lm_eval with --log_samples)")
        rows = [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]
        samples[task] = {row["doc_id"]: row for row in rows}
    return scores, samples


def differing(task: str, runs: list[dict]) -> list:
    """The doc ids whose responses in some run differ from the first run's (or are missing there)."""
    ref, out = runs[0][task], set()
    for samples in runs[1:]:
        other = samples.get(task, {})
        for doc in ref.keys() | other.keys():
            a, b = ref.get(doc, {}), other.get(doc, {})
            if (a.get("resps"), a.get("filtered_resps")) != (b.get("resps"), b.get("filtered_resps")):
                out.add(doc)
    return sorted(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="lm_eval --output_path folders")
    p.add_argument("--out", type=Path, help="summary JSON to write")
    args = p.parse_args()

    runs = [load_run(folder) for folder in args.runs]
    (scores0, samples0), ok, tasks = runs[0], True, {}
    for task in sorted(scores0):
        items = samples0[task]
        diff_items = differing(task, [samples for _, samples in runs])
        metrics = {name: [scores.get(task, {}).get(name) for scores, _ in runs]
                   for name in scores0[task] if "," in name and "_stderr," not in name}
        same_scores = all(len(set(map(repr, values))) == 1 for values in metrics.values())
        ok = ok and not diff_items and same_scores
        tasks[task] = {"items": len(items), "items_differing": len(diff_items), "differing_doc_ids": diff_items[:20],
                       "scores": metrics, "scores_equal": same_scores}

    names = [str(folder) for folder in args.runs]
    print(f"{'task':<22} {'metric':<20} " + " ".join(f"{f'run {i + 1}':>10}" for i in range(len(runs)))
          + f" {'items':>6} {'differ':>6}")
    for task, t in tasks.items():
        for metric, values in t["scores"].items():
            cells = " ".join(f"{v:>10.4f}" if isinstance(v, float) else f"{v!s:>10}" for v in values)
            print(f"{task:<22} {metric:<20} {cells} {t['items']:>6} {t['items_differing']:>6}")
    print("bitwise identical across runs" if ok else "DIFFERENT across runs")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": names, "identical": ok, "tasks": tasks}, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
