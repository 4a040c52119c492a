"""`margingate bench-linear`: our linear against `torch.nn.functional.linear` (oneDNN / MKL), on a
model's own weight shapes (qkv, o, gate_up, down, head), at several row counts, on every linear path
this CPU runs, side by side in one process at the same thread count. Writes report.json,
report.md and linear.png (GFLOP/s against rows)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from .. import cli_args
from ..analysis.outputs import write_report

ROWS = (1, 16, 64, 256, 2048)


def add_parser(sub) -> None:
    b = sub.add_parser("bench-linear", help="our linear against torch's on the model's shapes, every path")
    b.add_argument("--rows", type=cli_args.int_list, default=list(ROWS), help="row counts M (default 1,16,64,256,2048)")
    b.add_argument("--paths", default="", help="comma-separated subset of the CPU's linear paths (default: all)")
    b.add_argument("--seconds", type=float, default=0.4, help="timed seconds per measurement (median of 5 runs)")
    b.add_argument("--threads", type=cli_args.positive_int, default=None, help="torch threads (default: all)")
    b.add_argument("--model", default=cli_args.DEFAULT_MODEL, help="a named model or folder: its config's shapes")
    b.add_argument("--out", default="results/bench-linear")
    b.set_defaults(func=cmd_bench_linear)


def model_shapes(model: str) -> tuple[str, dict[str, tuple[int, int]]]:
    """The model's matrices (out features, in features) as the engine packs them (qkv and gate_up fused)."""
    from ..models.loader import load_config, resolve_model_dir

    c = load_config(resolve_model_dir(model))
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return c.name, {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
                    "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
                    "head": (c.vocab_size, c.hidden_size)}


def seconds_per_call(fn, budget: float) -> float:
    """Median over 5 runs of the mean time per call, each run about budget / 5 long."""
    fn()
    t = time.perf_counter()
    fn()
    reps = max(1, int(budget / 5 / max(time.perf_counter() - t, 1e-6)))
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t) / reps)
    return statistics.median(runs)


def measure(shapes: dict, rows: list[int], paths: list[str], budget: float) -> list[dict]:
    import torch  # when the command runs: building the command line loads no torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from ..kernels import invariant
    from ..kernels.packing import pack

    before, out = invariant.path_in_use("bf16"), []
    gen = torch.Generator().manual_seed(0)
    steps = tqdm(total=len(shapes) * len(rows), desc="bench-linear", unit="shape")
    try:
        for name, (n, k) in shapes.items():
            w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
            packed = pack(w)
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                flops = 2.0 * m * n * k
                row = {"shape": name, "n": n, "k": k, "m": m,
                       "library_gflops": flops / seconds_per_call(lambda: F.linear(x, w), budget) / 1e9}
                for p in paths:
                    invariant.use_path(p)
                    row[f"{p}_gflops"] = flops / seconds_per_call(lambda: invariant.linear(x, packed), budget) / 1e9
                out.append(row)
                steps.update()
    finally:
        invariant.use_path(before)
        steps.close()
    return out


def summarise(rows: list[dict], paths: list[str]) -> list[dict]:
    """Per M and path: time over all shapes (ours / library, as a rate ratio) and the GFLOP/s range."""
    out = []
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m]
        flops = [2.0 * r["m"] * r["n"] * r["k"] for r in at]
        lib_s = sum(f / r["library_gflops"] for f, r in zip(flops, at))
        for p in paths:
            ours_s = sum(f / r[f"{p}_gflops"] for f, r in zip(flops, at))
            rates = [r[f"{p}_gflops"] for r in at]
            out.append({"m": m, "path": p, "ratio": lib_s / ours_s, "gflops_min": min(rates),
                        "gflops_max": max(rates), "library_gflops_min": min(r["library_gflops"] for r in at),
                        "library_gflops_max": max(r["library_gflops"] for r in at)})
    return out


def markdown(report: dict) -> str:
    lines = [f"# Linear: ours against torch.nn.functional.linear, {report['model']} shapes, "
             f"{report['threads']} threads", "", f"Machine: {report['machine']}", "",
             "Ratio: library time / our time, summed over the shapes (> 1: ours faster).", "",
             "| M | path | ours / library | ours GFLOP/s | library GFLOP/s |", "|---:|---|---:|---:|---:|"]
    for s in report["summary"]:
        lines.append(f"| {s['m']} | {s['path']} | {s['ratio']:.2f}x | {s['gflops_min']:.0f}-{s['gflops_max']:.0f} | "
                     f"{s['library_gflops_min']:.0f}-{s['library_gflops_max']:.0f} |")
    lines += ["", "| shape | N x K | M | library GFLOP/s | " + " | ".join(report["paths"]) + " |",
              "|---|---|---:|---:|" + "---:|" * len(report["paths"])]
    for r in report["rows"]:
        cells = " | ".join(f"{r[p + '_gflops']:.0f}" for p in report["paths"])
        lines.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['m']} | {r['library_gflops']:.0f} | {cells} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ms = sorted({r["m"] for r in report["rows"]})
    total = {m: sum(2.0 * r["m"] * r["n"] * r["k"] for r in report["rows"] if r["m"] == m) for m in ms}
    for key, label in [("library", "torch F.linear"), *((p, f"ours: {p}") for p in report["paths"])]:
        secs = {m: sum(2.0 * r["m"] * r["n"] * r["k"] / r[f"{key}_gflops"] for r in report["rows"] if r["m"] == m)
                for m in ms}
        ax.plot(ms, [total[m] / secs[m] for m in ms], marker="o", label=label)
    ax.set(xscale="log", xlabel="rows M", ylabel="GFLOP/s (all shapes)",
           title=f"Linear on {report['model']} shapes, {report['threads']} threads")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "linear.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [path]


def cmd_bench_linear(args) -> None:
    import torch

    from ..environment import cpu_info
    from ..kernels import invariant

    if args.threads:
        torch.set_num_threads(args.threads)
    have = invariant.usable_paths("bf16")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()] or have
    missing = [p for p in paths if p not in have]
    if missing:
        raise ValueError(f"--paths: {', '.join(missing)} cannot run here (this CPU runs {', '.join(have)})")
    model, shapes = model_shapes(args.model)
    rows = measure(shapes, args.rows, paths, args.seconds)
    flags = [f for f in ("avx512_bf16", "amx_bf16") if f in (cpu_info("flags") or "").split()]
    report = {"model": model, "threads": torch.get_num_threads(), "torch": torch.__version__, "paths": paths,
              "machine": f"{cpu_info('model name')} ({', '.join(flags) or 'no avx512_bf16, no amx'}), "
                         f"{torch.get_num_threads()} threads, torch {torch.__version__}",
              "summary": summarise(rows, paths), "rows": rows}
    write_report(report, Path(args.out), markdown, plot)
    print(markdown(report))
