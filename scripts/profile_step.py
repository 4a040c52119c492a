"""Where a decode step's time goes, by kind of work, for `fast-library`, `fast` and `batch-invariant`.

    .venv/bin/python scripts/profile_step.py --batch-sizes 1,8,16     # -> results/bench/step_profile.{json,md}
    .venv/bin/python scripts/profile_step.py --model FILE.gguf --batch-sizes 16 --policies fast --out DIR

For each policy and batch size, B requests (the built-in prompts) decode 32 tokens, then STEPS
decode steps run under cProfile. The time of every built-in call is attributed to a kind: GEMMs
(ours or the library's), attention, KV writes, norms and activations, sampling, and the rest
(Python, tensor bookkeeping). Inside the one-call compiled stack (`decoder_stack`) the kernels'
own phase timers split the time the same way. cProfile adds a little to each Python call, so
the `rest` share is an upper bound; the step time column is measured without the profiler.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

from margingate.analysis.outputs import machine_line
from margingate.data.prompts import builtin_prompts
from margingate.engine import Request
from margingate.kernels import invariant
from margingate.llm import LLM

STEPS = 20
STACK = "margingate_invariant.decoder_stack"
STACK_PHASES = {"norms": "norms, silu", "gemm": "gemm (ours)", "rope, kv write": "kv write",
                "attention": "attention (ours)", "residual, silu": "norms, silu"}
KINDS = {  # substring of a profiled function's name -> kind (first match wins)
    "margingate_invariant.linear": "gemm (ours)", "_nn.linear": "gemm (library)",
    "margingate_invariant.attention": "attention (ours)", "scaled_dot_product_attention": "attention (library)",
    "kv_cache.py": "kv write", "rmsnorm": "norms, silu", "silu": "norms, silu", "pow": "norms, silu",
    "mean": "norms, silu", "rsqrt": "norms, silu", "argmax": "sampling",
}


def kind_of(name: str) -> str:
    return next((k for s, k in KINDS.items() if s in name), "rest (python, bookkeeping)")


def profile(llm: LLM, policy: str, b: int) -> dict:
    engine = llm.engine
    prompts = builtin_prompts()
    seqs = [engine.add_request(Request(llm.tokenizer.encode_prompt(prompts[i % len(prompts)]), 32 + 2 * STEPS + 8,
                                       llm.policy(policy), ignore_eos=True, request_id=f"{policy}-{b}-{i}"))
            for i in range(b)]
    try:
        while min(len(s.output_ids) for s in seqs) < 32:
            engine.step()
        times = []
        for _ in range(STEPS // 2):
            t = time.perf_counter()
            engine.step()
            times.append(1000 * (time.perf_counter() - t))
        prof = cProfile.Profile()
        invariant.ops().stack_profile(True)
        prof.enable()
        for _ in range(STEPS // 2):
            engine.step()
        prof.disable()
        phases = invariant.ops().stack_profile(False)
    finally:
        for s in seqs:
            engine.abort(s.request_id)
        engine.step()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    by_kind: dict[str, float] = {}
    for (file, _, name), (_, _, tottime, _, _) in stats.items():
        if STACK in f"{file}:{name}":  # split by the stack's own timers; what they miss is the rest
            timed = sum(ms for _, ms in phases) / 1000
            pieces = [(STACK_PHASES[p], ms / 1000) for p, ms in phases] + [(kind_of(""), tottime - timed)]
        else:
            pieces = [(kind_of(f"{file}:{name}"), tottime)]
        for kind, seconds in pieces:
            by_kind[kind] = by_kind.get(kind, 0.0) + 1000 * seconds / (STEPS // 2)
    return {"step_ms": statistics.median(times), "ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# One decode step, by kind of work\n\n{machine_line(env)}; ms per step (cProfile, {STEPS // 2} "
             "steps at ~40 tokens of context; `step ms` without the profiler).\n"]
    kinds = sorted({k for r in report["runs"] for k in r["ms_by_kind"]})
    lines.append("| policy | B | step ms | " + " | ".join(kinds) + " |")
    lines.append("|---|---:|---:|" + "---:|" * len(kinds))
    for r in report["runs"]:
        cells = " | ".join(f"{r['ms_by_kind'].get(k, 0):.2f}" for k in kinds)
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
