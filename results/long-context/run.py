"""Long context on a real quantized file: prefill and decode at 2,000, 8,000 and 16,000 prompt tokens, ours
beside llama.cpp on the same GGUF (Qwen2.5-Coder-0.5B-Instruct, `make models`), the same token ids, the same
thread count, one process at a time. llama.cpp runs with flash attention on and off (the faster counts);
we run with no context flag (the model's own 32,768 positions, the KV pool's default size).

    flock /tmp/mg-measure.lock .venv/bin/python results/long-context/run.py [--lengths 2000,8000,16000] [--new 32]
        [--threads 2] [--llamacpp-python .venv-llamacpp/bin/python]

Writes results/long-context/long_context.json, long_context.md and long_context.png. Each timed run records the
machine's load (`uptime`) before and after it: a figure taken while something else ran says so.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from margingate.analysis.outputs import uptime

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL = "qwen2.5-coder-0.5b"


def prompt_ids(tokenizer, n: int) -> list[int]:
    """n token ids of real text: the built-in prompts, one after another, as often as needed."""
    from margingate.data.prompts import builtin_text

    ids = tokenizer.encode(builtin_text())
    return (ids * (n // len(ids) + 1))[:n]


def ours(llm, ids: list[int], new: int) -> dict:
    from margingate.engine import Request

    engine = llm.engine
    seq = engine.add_request(Request(ids, new, ignore_eos=True, request_id=f"long-{len(ids)}"))
    t = time.perf_counter()
    while not seq.output_ids:
        engine.step()
    prefill = time.perf_counter() - t
    engine.step()  # the first decode step is not timed (nor is llama.cpp's): one-time costs stay out of the rate
    t = time.perf_counter()
    while engine.has_work:
        engine.step()
    return {"prefill_s": prefill, "decode_s": time.perf_counter() - t, "decode_steps": new - 2,
            "tokens": list(seq.output_ids)}


def timed(run, *args) -> dict:
    """run(*args), with `uptime` before and after."""
    before = uptime()
    out = run(*args)
    return {**out, "uptime_before": before, "uptime_after": uptime()}


def llamacpp(python: str, gguf: str, ids: list[int], new: int, threads: int, flash_attn: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"gguf": gguf, "prompt_ids": ids, "new": new, "threads": threads,
                                   "flash_attn": flash_attn}))
        subprocess.run([python, str(HERE / "llamacpp_long.py"), str(job), str(out)], check=True)
        return json.loads(out.read_text())


def rates(r: dict, n: int) -> dict:
    return {"prefill_tok_s": n / r["prefill_s"], "decode_tok_s": r["decode_steps"] / r["decode_s"]}


def table(rows: list[dict]) -> str:
    lines = ["| prompt tokens | ours prefill tok/s | llama.cpp prefill (fa on / off) | ratio | ours decode tok/s | "
             "llama.cpp decode (fa on / off) | ratio | same first 8 tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, on, off = r["ours"], r["llamacpp_fa_on"], r["llamacpp_fa_off"]
        best_p, best_d = max(on["prefill_tok_s"], off["prefill_tok_s"]), max(on["decode_tok_s"], off["decode_tok_s"])
        lines.append(f"| {r['length']:,} | {o['prefill_tok_s']:.0f} | {on['prefill_tok_s']:.0f} / "
                     f"{off['prefill_tok_s']:.0f} | {o['prefill_tok_s'] / best_p:.2f}x | {o['decode_tok_s']:.1f} | "
                     f"{on['decode_tok_s']:.1f} / {off['decode_tok_s']:.1f} | {o['decode_tok_s'] / best_d:.2f}x | "
                     f"{r['same_first_tokens']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["length"] for r in rows]
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s", "decode at that context")):
        for name in ("ours", "llamacpp_fa_on", "llamacpp_fa_off"):
            ax.plot(xs, [r[name][key] for r in rows], marker="o", label=name.replace("_", " "))
        ax.set(xlabel="prompt tokens", ylabel="tokens / s", title=title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2000,8000,16000")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--llamacpp-python", default=str(REPO / ".venv-llamacpp/bin/python"))
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from margingate.analysis.outputs import machine_line
    from margingate.environment import environment_record
    from margingate.llm import LLM
    from margingate.models.loader import gguf_parts

    llm = LLM(MODEL, num_threads=args.threads, max_num_seqs=1)
    gguf = str(gguf_parts(MODEL)[0])
    rows = []
    for n in map(int, args.lengths.split(",")):
        ids = prompt_ids(llm.tokenizer, n)
        o = timed(ours, llm, ids, args.new)
        on = timed(llamacpp, args.llamacpp_python, gguf, ids, args.new, args.threads, True)
        off = timed(llamacpp, args.llamacpp_python, gguf, ids, args.new, args.threads, False)
        rows.append({"length": n, "ours": {**o, **rates(o, n)}, "llamacpp_fa_on": {**on, **rates(on, n)},
                     "llamacpp_fa_off": {**off, **rates(off, n)},
                     "same_first_tokens": o["tokens"][:8] == on["tokens"][:8]})
        print(table(rows[-1:]), flush=True)
        for name in ("ours", "llamacpp_fa_on", "llamacpp_fa_off"):
            print(f"  {name}: before {rows[-1][name]['uptime_before']}\n  {'':{len(name)}}  after  "
                  f"{rows[-1][name]['uptime_after']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": MODEL, "gguf": gguf, "threads": args.threads, "cpu": machine_line(environment_record(llm)),
              "max_model_len": llm.engine.max_len, "kv_pool_blocks": llm.engine.kv.num_blocks, "rows": rows}
    (out / "long_context.json").write_text(json.dumps(report, indent=1))
    (out / "long_context.md").write_text(f"{MODEL}, {args.threads} threads, {report['cpu']}\n\n{table(rows)}\n")
    plot(rows, out / "long_context.png")
    print(table(rows))


if __name__ == "__main__":
    main()
