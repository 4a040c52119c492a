"""The paper's table on one GPU: MarginGate against LLM-42's decode-verify-rollback, at the hardware's speed.

    python results/gpu/paper_table.py --out OUT                  # CUDA: Llama-3.1-8B and Qwen2.5-14B shapes
    python results/gpu/paper_table.py --device cpu --out OUT     # dry run: toy shapes, Triton's interpreter

Per shape, in one process (margingate/paper_table/ says how): a random-weight bf16 model of its sizes; tau by
`margingate calibrate`'s rule on calibration prompts that are neither checked nor timed, at the table's batch
sizes; the check (sequence determinism and digests; graphs against eager); then per batch size and policy
(fast, batch-invariant, margin, dvr with W 64 and G 8 as LLM-42, verify-all) a warm-up and several timed
runs, prefill timed apart: the decode step's time and spread, the increase over fast, margin's trigger rate,
and dvr's increase over margin's beside the paper's 2.23x / 1.99x.

OUT/paper.json and OUT/paper.md are rewritten after every part. `--deadline-s`: no point starts that the last
point's length says would end past it. SIGTERM: saves and exits 124. Exit 3: stopped by the deadline with
points not reached (the report lists them). OUT must be empty unless `--resume`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from margingate.paper_table.report import markdown  # noqa: E402
from margingate.paper_table.runner import TableConfig, run_shape  # noqa: E402
from margingate.paper_table.store import Clock, Store, hard_stop_of, stop_on_sigterm  # noqa: E402

# per device: shapes, B, new, calibration new, prompt lengths, check prompts, dvr W and G, graphs
DEFAULTS = {"cuda": ("llama-3.1-8b,qwen2.5-14b", "1,8,32,64", 256, 128, (64, 192), 8, 64, 8, "cuda"),
            # the dry run's scale: 4 dvr windows per request as on the GPU (256 / 64)
            "cpu": ("toy", "1,2", 8, 6, (4, 12), 2, 2, 2, "stand-in")}


def bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy, read and written bytes counted."""
    if device != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 10 * x.numel() / (time.perf_counter() - t)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", help="comma-separated (default: both models; cpu: toy)")
    p.add_argument("--batch-sizes", help="default 1,8,32,64 (cpu: 1,2)")
    p.add_argument("--new", type=int, help="new tokens per timed request (default 256; cpu: 8)")
    p.add_argument("--cal-new", type=int, help="new tokens per calibration request (default 128; cpu: 6)")
    p.add_argument("--window", type=int, help="dvr's W (default 64; cpu: 2)")
    p.add_argument("--group", type=int, help="dvr's G (default 8; cpu: 2)")
    p.add_argument("--check-prompts", type=int, help="default 8 (cpu: 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cal-batches", type=int, default=2, help="calibration batches per batch size")
    p.add_argument("--cal-points", type=int, default=4, help="taus swept at most")
    p.add_argument("--graphs", choices=("cuda", "stand-in", "off"), help="default cuda (cpu: stand-in)")
    p.add_argument("--deadline-s", type=float, help="no point starts past this (the run's own clock)")
    p.add_argument("--resume", action="store_true", help="keep what OUT/paper.json finished")
    return p.parse_args()


def config(args) -> tuple[list[str], TableConfig]:
    shapes, sizes, new, cal_new, plen, checks, window, group, graphs = DEFAULTS[args.device]
    batch_sizes = [int(b) for b in (args.batch_sizes or sizes).split(",")]
    if min(batch_sizes) < 1:
        raise SystemExit(f"batch sizes must be >= 1, got {batch_sizes}")
    cfg = TableConfig(args.device, batch_sizes, args.new or new, args.cal_new or cal_new, plen,
                      args.check_prompts or checks, args.window or window, args.group or group, args.warmup,
                      args.repeats, args.cal_batches, args.cal_points, args.graphs or graphs, bandwidth(args.device))
    return (args.shapes or shapes).split(","), cfg


def main() -> int:
    args = parse()
    stop_on_sigterm()
    clock = Clock(args.deadline_s)
    shapes, cfg = config(args)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "dry-run-cpu"
    rep = {"device": device_name, "torch": torch.__version__, "bandwidth_GBps": cfg.bandwidth / 1e9,
           "settings": {k: v for k, v in vars(cfg).items() if k != "bandwidth"}, "shapes": {}}
    store = Store(args.out, rep, markdown, args.resume)
    store.save()
    try:
        for name in shapes:
            run_shape(name, cfg, store, clock)
    except BaseException as exc:  # the report says how the run ended before anything else happens
        stop = hard_stop_of(exc)
        store.report["stopped"] = {"by": str(stop or f"{type(exc).__name__}: {exc}"), "after_s": clock.elapsed()}
        store.save()
        if stop is None:
            raise  # a failure: its traceback, exit 1
        print(f"stopped by {stop} after {clock.elapsed():.0f} s; saved {args.out}/paper.json", flush=True)
        return 124
    missing = [x for r in store.report["shapes"].values() for x in r.get("not_reached", [])] + \
        store.report.get("cut", [])
    if missing:
        store.report["stopped"] = {"by": "the deadline", "after_s": clock.elapsed()}
    store.save()
    print(markdown(store.report))
    return 3 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
