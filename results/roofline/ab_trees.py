"""B = 1 decode against the read floor for two source trees of margingate, alternating in fresh processes so
that both see the same machine, round after round (the host's read bandwidth moves within minutes).

    git worktree add /tmp/before <commit>
    flock /tmp/mg-measure.lock .venv/bin/python results/roofline/ab_trees.py --model A.gguf \\
        --tree before=/tmp/before --tree after=$PWD [--rounds 4] --out results/roofline/<name>

Each child imports margingate from its tree (PYTHONPATH; each tree builds and caches its own kernels), loads
the model (a packed-cache hit), reads the bandwidth (analysis/roofline.measure) and runs `decode_roofline`
three times. Writes report.json and report.md (analysis/outputs.write_report), `uptime` before and after.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from margingate.analysis.outputs import alternate, uptime

CHILD = """
import json, sys
from margingate.llm import LLM
llm = LLM(sys.argv[1], max_num_seqs=1)
from margingate.analysis.roofline import measure
from margingate.analysis.step_profile import decode_roofline
bw = measure(llm.engine.num_threads).read_gb_s
runs = [decode_roofline(llm, bw) for _ in range(3)]
print(json.dumps({"read_gb_s": bw, "floor_ms": runs[0]["floor_ms"], "step_ms": [r["step_ms"] for r in runs],
                  "linear_ms": [r["ms_by_kind"]["linear"] for r in runs]}))
"""


def child(model: str, name: str, tree: str) -> dict:
    # run from a folder with no margingate in it, so that PYTHONPATH decides which tree is imported
    done = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, cwd="/",
                          env={**os.environ, "PYTHONPATH": tree})
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return {"tree": name, **json.loads(done.stdout.strip().splitlines()[-1])}


def table(report: dict) -> str:
    lines = [f"# Two trees, B = 1 decode: {Path(report['model']).name}\n\n{report['cpu']}, 2 threads. Trees: "
             + ", ".join(f"{k} `{v}`" for k, v in report["trees"].items())
             + f". uptime before: `{report['uptime_before']}`; after: `{report['uptime_after']}`.\n",
             "| round | tree | read GB/s | floor ms | step ms (3 runs) | linear ms (3 runs) |",
             "|---:|---|---:|---:|---|---|"]
    n = len(report["trees"])
    for i, r in enumerate(report["runs"]):
        lines.append(f"| {i // n + 1} | {r['tree']} | {r['read_gb_s']:.1f} | {r['floor_ms']:.2f} | "
                     + ", ".join(f"{s:.2f}" for s in r["step_ms"]) + " | "
                     + ", ".join(f"{s:.2f}" for s in r["linear_ms"]) + " |")
    for name in report["trees"]:
        mine = [r for r in report["runs"] if r["tree"] == name]
        med = statistics.median(s for r in mine for s in r["step_ms"])
        frac = statistics.median(r["floor_ms"] / s for r in mine for s in r["step_ms"])
        lines.append(f"\n{name}: median step {med:.2f} ms, median fraction of the floor {100 * frac:.0f} %.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tree", action="append", required=True, help="name=path (repeatable)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from margingate.environment import cpu_info

    trees = dict(t.split("=", 1) for t in args.tree)
    report = {"model": args.model, "cpu": cpu_info("model name"), "trees": trees, "uptime_before": uptime(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
    alternate(report, args.rounds, {name: functools.partial(child, args.model, name, tree)
                                    for name, tree in trees.items()}, Path(args.out), table)


if __name__ == "__main__":
    main()
