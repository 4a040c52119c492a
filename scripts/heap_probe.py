"""`margingate serve` with a thread that logs where its memory is (issue 47: the soak's VmRSS growth).

    PYTHONPATH=. .venv/bin/python scripts/heap_probe.py --log /tmp/probe.jsonl -- serve --port 8731
    PYTHONPATH=. .venv/bin/python scripts/soak.py --url http://127.0.0.1:8731 --pid PID --minutes 3

Every `--every` seconds one JSON line: VmRSS, RssAnon, RssFile and threads (/proc/self/status); glibc's
mallinfo2 in KiB (`arena`: the heaps' size, `uordblks`: in use, `fordblks`: free but kept, `hblkhd`: mapped
blocks) and the arenas' count (malloc_info); with `--trace`, the Python heap (tracemalloc) and, once a
minute after `--trace-base` seconds, the lines whose Python allocations grew most since then. Touching
`--trim-file` makes the next sample call malloc_trim(0) and log what it gave back. Linux and glibc only.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

MALLINFO = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO]


LIBC = ctypes.CDLL(None)
LIBC.mallinfo2.restype = MallInfo2
LIBC.fopen.restype, LIBC.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
LIBC.fclose.argtypes = [ctypes.c_void_p]
LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]


def status() -> dict:
    text = Path("/proc/self/status").read_text()
    return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in text.splitlines())
            if k in ("VmRSS", "RssAnon", "RssFile", "Threads")}


def arenas() -> int:
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = LIBC.fopen(f.name.encode(), b"w")
        LIBC.malloc_info(0, fp)
        LIBC.fclose(fp)
        return len(re.findall(r"<heap nr=", Path(f.name).read_text()))


def sample(args, t: float, base) -> tuple[dict, object]:
    mi = LIBC.mallinfo2()
    rec = {"t": round(t, 1), **status(), "arenas": arenas(), "hblks": mi.hblks,
           **{k: getattr(mi, k) // 1024 for k in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost")}}
    if args.trace:
        rec["traced_kb"] = tracemalloc.get_traced_memory()[0] // 1024
        if t >= args.trace_base and (base is None or int(t) % 60 < args.every):
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            if base is None:
                base, rec["trace_baseline"] = snap, True
            else:
                rec["trace_top_growth"] = [str(s) for s in snap.compare_to(base, "lineno")[:12]]
    if args.trim_file and os.path.exists(args.trim_file):
        os.unlink(args.trim_file)
        t0 = time.perf_counter()
        LIBC.malloc_trim(0)
        rec["trim_ms"] = round(1000 * (time.perf_counter() - t0), 2)
        rec.update({f"after_trim_{k}": v for k, v in status().items()})
    return rec, base


def monitor(args) -> None:
    t0, base = time.monotonic(), None
    with open(args.log, "a") as f:
        while True:
            time.sleep(args.every)
            rec, base = sample(args, time.monotonic() - t0, base)
            f.write(json.dumps(rec) + "\n")
            f.flush()


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", required=True, help="JSON lines, appended")
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--trace", action="store_true", help="tracemalloc (slow, and its own memory shows in RSS)")
    p.add_argument("--trace-base", type=float, default=60.0, help="seconds: the Python heap's baseline")
    p.add_argument("--trim-file", default=None, help="touch it to malloc_trim(0) at the next sample")
    args = p.parse_args(argv[:split])
    if args.trace:
        tracemalloc.start(1)
    threading.Thread(target=monitor, args=(args,), name="heap-probe", daemon=True).start()
    from margingate.cli import main as margingate

    return margingate(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
