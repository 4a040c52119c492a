"""B = 1 decode against the memory-read floor, per model, with the step's profile: results/roofline.

    flock /tmp/mg-measure.lock .venv/bin/python scripts/roofline.py --model A.gguf --model B.gguf ...

The machine's read bandwidth is measured once (analysis/roofline.measure: a sum over a 2 GiB buffer at the
engine's threads, best of 5), then for each model `analysis/step_profile.decode_roofline`, what `margingate
bench` reports: the bytes a B = 1 step must read (weights as stored, K/V), the floor they set, the step
measured and the fraction reached, and the step split into linear, attention, norms / rotary / K/V writes,
logits and sampling, and Python. Writes roofline.json and roofline.md; `uptime` before and after in both.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from margingate.analysis.outputs import machine_line, uptime
from margingate.analysis.roofline import BANDWIDTH_BYTES, measure
from margingate.analysis.step_profile import KINDS, decode_roofline
from margingate.llm import LLM


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# B = 1 decode against the read floor\n\n{report['cpu_line']}. Read bandwidth "
             f"**{m['read_gb_s']:.1f} GB/s** (a {BANDWIDTH_BYTES >> 30} GiB `torch.sum` at {m['threads']} threads, "
             f"best of 5). Floor = (weights as stored + K/V) / bandwidth; fraction = floor / step. Profile: ms per "
             "step by kind (cProfile and the compiled stack's phase timers, 10 steps after the 10 timed ones; `python, "
             "rest` is an upper bound; on a busy machine the two sets of steps differ).\n\nuptime before: "
             f"`{report['uptime_before']}`; after: `{report['uptime_after']}`.\n",
             "| model | MiB read / step | floor ms | step ms | fraction | " + " | ".join(KINDS) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(KINDS)]
    for name, r in report["models"].items():
        kinds = " | ".join(f"{r['ms_by_kind'][k]:.2f}" for k in KINDS)
        lines.append(f"| {name} | {(r['weight_bytes'] + r['kv_bytes']) / 2**20:.0f} | {r['floor_ms']:.2f} | "
                     f"{r['step_ms']:.2f} | **{100 * r['fraction']:.0f} %** | {kinds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="a GGUF file, folder or named model (repeatable)")
    p.add_argument("--out", default="results/roofline")
    args = p.parse_args(argv)
    report = {"uptime_before": uptime(), "date": time.strftime("%Y-%m-%d %H:%M"), "models": {}}
    for model in args.model:
        llm = LLM(model, max_num_seqs=1)
        if "machine" not in report:  # at the engine's thread count
            report["machine"] = asdict(measure(llm.engine.num_threads))
            report["environment"] = llm.environment()
            report["cpu_line"] = machine_line(report["environment"])
        report["models"][Path(model).name] = decode_roofline(llm, report["machine"]["read_gb_s"])
        print(f"{model}: {report['models'][Path(model).name]['step_ms']:.2f} ms/step", file=sys.stderr)
        del llm
    report["uptime_after"] = uptime()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "roofline.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
