"""Our prefill and decode at long context with two checkouts of margingate, one process at a time and alternating
(new, old, new, old), so that both meet the same machine: the figure for a kernel change when llama.cpp cannot
be run beside it on a quiet machine. Each run records its wall and CPU seconds and `uptime` before and after: on a
shared machine the CPU seconds are the steadier measure of the work.

    git archive BASE | tar -x -C /tmp/old        # the checkout before the change (its kernels build once)
    flock /tmp/mg-measure.lock .venv/bin/python results/long-context/before_after.py --old /tmp/old \\
        [--lengths 8000,16000] [--new 12] [--out results/long-context/before_after.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(n: int, new: int) -> None:
    """In a fresh process: our prefill of n tokens and `new` decode steps, as run.py times them."""
    sys.path.insert(0, str(HERE))
    import run as R

    from margingate.llm import LLM

    llm = LLM(R.MODEL, num_threads=2, max_num_seqs=1)
    ids = R.prompt_ids(llm.tokenizer, n)
    before, cpu = R.uptime(), time.process_time()
    o = R.ours(llm, ids, new)
    print(json.dumps({"length": n, "prefill_s": o["prefill_s"], "prefill_tok_s": n / o["prefill_s"],
                      "decode_tok_s": o["decode_steps"] / o["decode_s"], "cpu_s": time.process_time() - cpu,
                      "first_tokens": o["tokens"][:8], "uptime_before": before, "uptime_after": R.uptime()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="a checkout of margingate before the change")
    ap.add_argument("--lengths", default="8000,16000")
    ap.add_argument("--new", type=int, default=12)
    ap.add_argument("--out", default=str(HERE / "before_after.json"))
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.new)
    rows = []
    for n in map(int, args.lengths.split(",")):
        for name, tree in (("new", str(HERE.parents[1])), ("old", args.old)):
            env = {**os.environ, "PYTHONPATH": tree}
            cmd = [sys.executable, __file__, "--old", args.old, "--new", str(args.new), "--child", str(n)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows.append({"code": name, "tree": tree, **json.loads(out.strip().splitlines()[-1])})
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
