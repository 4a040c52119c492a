"""B = 1 decode and start time with the packed matrices mapped (the default) and in huge pages of the process's
own (`MARGINGATE_WEIGHTS_MEMORY=huge`, models/weights_memory.py), alternating in fresh processes so that each
sees the same machine, round after round. Mapped twice: the cache file as the cache writes it (whole 2 MiB
pieces, packed_cache.WholePieces: the page cache's 2 MiB folios, PMD-mapped) and `mapped-4k`, the same bytes
copied by `shutil.copyfile` (sendfile, which fills the page cache in 4 KiB folios here: 0 MB PMD-mapped).
Each child reports its FilePmdMapped.

    flock /tmp/mg-measure.lock env PYTHONPATH=$PWD .venv/bin/python results/roofline/huge_pages.py \\
        --model /tmp/mg-start/random-1b.q4_k_m.gguf [--rounds 4] [--out results/roofline/huge-pages]

Each child: `import` + `LLM(model)` timed (a packed-cache hit), the read bandwidth measured
(analysis/roofline.measure), then `decode_roofline` (what `margingate bench` and scripts/roofline.py report)
three times. Writes report.json and report.md (analysis/outputs.write_report), `uptime` before and after.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from margingate.analysis.outputs import alternate, uptime

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from margingate.llm import LLM
llm = LLM(sys.argv[1], max_num_seqs=1)
start = time.perf_counter() - t0
from margingate.analysis.roofline import measure
from margingate.analysis.step_profile import decode_roofline
bw = measure(llm.engine.num_threads).read_gb_s
runs = [decode_roofline(llm, bw) for _ in range(3)]
smaps = {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in open("/proc/self/smaps_rollup") if ":" in l)}
print(json.dumps({"start_s": start, "read_gb_s": bw, "floor_ms": runs[0]["floor_ms"],
                  "step_ms": [r["step_ms"] for r in runs], "anon_huge_mb": smaps.get("AnonHugePages", 0) // 1024,
                  "file_pmd_mb": smaps.get("FilePmdMapped", 0) // 1024}))
"""
MODES = ("mapped", "mapped-4k", "huge")


def rewrite(cache_file: Path, whole_pieces: bool) -> None:
    """The cache file's bytes written anew (a new inode, so the page cache holds what these writes made)."""
    from margingate.models.packed_cache import WholePieces

    tmp = cache_file.with_suffix(".rewrite")
    if whole_pieces:
        with open(cache_file, "rb") as src, open(tmp, "wb", buffering=0) as raw:
            out = WholePieces(raw)
            while chunk := src.read(8 << 20):
                out.write(chunk)
            out.close()
    else:
        shutil.copyfile(cache_file, tmp)
    os.replace(tmp, cache_file)


def child(model: str, mode: str, cache_file: Path | None = None) -> dict:
    if cache_file is not None:
        rewrite(cache_file, whole_pieces=mode != "mapped-4k")
    env = {**os.environ, "MARGINGATE_WEIGHTS_MEMORY": "huge" if mode == "huge" else "mapped"}
    done = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}


def table(report: dict) -> str:
    lines = [f"# Packed matrices mapped vs in huge pages: {Path(report['model']).name}\n\n{report['cpu']}, "
             f"2 threads. uptime before: `{report['uptime_before']}`; after: `{report['uptime_after']}`.\n",
             "| round | weights memory | start s | read GB/s | floor ms | step ms (3 runs) | best fraction | "
             "AnonHugePages MB | FilePmdMapped MB |", "|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for i, r in enumerate(report["runs"]):
        steps = ", ".join(f"{s:.2f}" for s in r["step_ms"])
        lines.append(f"| {i // len(MODES) + 1} | {r['mode']} | {r['start_s']:.2f} | {r['read_gb_s']:.1f} | "
                     f"{r['floor_ms']:.2f} | {steps} | {100 * r['floor_ms'] / min(r['step_ms']):.0f} % | "
                     f"{r['anon_huge_mb']} | {r['file_pmd_mb']} |")
    for mode in MODES:
        mine = [r for r in report["runs"] if r["mode"] == mode]
        med = statistics.median(s for r in mine for s in r["step_ms"])
        frac = statistics.median(r["floor_ms"] / s for r in mine for s in r["step_ms"])
        lines.append(f"\n{mode}: median step {med:.2f} ms, median fraction of the floor {100 * frac:.0f} %, median "
                     f"start {statistics.median(r['start_s'] for r in mine):.2f} s.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="results/roofline/huge-pages")
    args = ap.parse_args()
    from margingate.environment import cpu_info

    report = {"model": args.model, "cpu": cpu_info("model name"), "uptime_before": uptime(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
    child(args.model, "mapped")  # the packed cache written, the file in the page cache
    from margingate.paths import cache_root

    cache_file = max((cache_root() / "packed").glob(f"{Path(args.model).stem}-*.safetensors"),
                     key=lambda f: f.stat().st_mtime)
    alternate(report, args.rounds, {mode: functools.partial(child, args.model, mode, cache_file) for mode in MODES},
              Path(args.out), table)


if __name__ == "__main__":
    main()
