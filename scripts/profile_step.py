"""Where a decode step's time goes, by kind of work, for `fast-library`, `fast` and `batch-invariant`.

    .venv/bin/python scripts/profile_step.py --batch-sizes 1,8,16     # -> results/bench/step_profile.{json,md}
    .venv/bin/python scripts/profile_step.py --model FILE.gguf --batch-sizes 16 --policies fast --out DIR

For each policy and batch size, B requests (the built-in prompts) decode 32 tokens, then 10 steps are
timed and 10 run under cProfile (margingate/analysis/step_profile.py, which `margingate bench` uses for its
B = 1 roofline): linear, attention, norms / rotary / K/V writes, logits and sampling, and the rest (Python,
tensor bookkeeping). Inside the one-call compiled stack (`decoder_stack`) the kernels' own phase timers split
the time the same way. cProfile adds a little to each Python call, so the `rest` share is an upper bound; the
step time column is measured without the profiler.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from margingate.analysis.outputs import machine_line
from margingate.analysis.step_profile import KINDS, STEPS, profile
from margingate.llm import LLM


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# One decode step, by kind of work\n\n{machine_line(env)}; ms per step (cProfile, {STEPS // 2} "
             "steps at ~40 tokens of context; `step ms` without the profiler).\n"]
    lines.append("| policy | B | step ms | " + " | ".join(KINDS) + " |")
    lines.append("|---|---:|---:|" + "---:|" * len(KINDS))
    for r in report["runs"]:
        cells = " | ".join(f"{r['ms_by_kind'].get(k, 0):.2f}" for k in KINDS)
        lines.append(f"| {r['policy']} | {r['batch_size']} | {r['step_ms']:.2f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model folder or GGUF file (default: the embedded model)")
    p.add_argument("--batch-sizes", default="1,8,16")
    p.add_argument("--policies", default="fast-library,fast,batch-invariant")
    p.add_argument("--out", default="results/bench")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    runs, env = [], None
    for b in sizes:
        llm = LLM(args.model, max_num_seqs=b) if args.model else LLM(max_num_seqs=b)
        env = llm.environment()
        for policy in args.policies.split(","):
            runs.append({"policy": policy, "batch_size": b, **profile(llm, policy, b)})
            print(f"B={b} {policy}: {runs[-1]['step_ms']:.2f} ms/step", file=sys.stderr)
    report = {"environment": env, "steps": STEPS, "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_profile.json").write_text(json.dumps(report, indent=2))
    (out / "step_profile.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
