"""Writing a measurement's outputs (report.json, report.md, plots) and the number formats of its tables."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path


def fmt(v, pct: bool = False, digits: int = 3) -> str:
    """A table cell: "-" for a missing value (None, NaN); a share as a percentage with 2 decimals;
    an integer as is; any other number with `digits` significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if pct:
        return percent(v, 2)
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def percent(v: float | None, decimals: int = 1) -> str:
    """A share as a percentage: 0.125 -> "12.5%"; None -> "-"."""
    return "-" if v is None else f"{100 * v:.{decimals}f}%"


def rss_mb() -> float | None:
    """This process's resident memory now (VmRSS), in MB; None where /proc is not there."""
    try:
        line = next(s for s in open("/proc/self/status") if s.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def uptime() -> str:
    """The machine's load as `uptime` prints it: each timed run records it before and after, so that a figure
    taken while something else ran says so."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine_line(env: dict) -> str:
    """What the numbers ran on, in one line: CPU and ISA, threads, torch, kernel version and path."""
    return (f"{env.get('cpu', '?')} ({', '.join(env.get('cpu_isa', [])) or 'ISA ?'}), "
            f"{env.get('num_threads')} threads, torch {env.get('torch')}, kernels v{env.get('kernels_version')} "
            f"(bf16 linear: {env.get('kernels_linear_path')}"
            + "".join(f"; {p} REFUSED at load" for p in env.get("kernels_linear_refused") or {}) + ")")


def write_report(report: dict, out: Path, markdown: Callable[[dict], str],
                 plots: Callable[[dict, Path], Iterable[Path]] | None = None, indent: int = 1) -> list[Path]:
    """Write `out`/report.json and `out`/report.md (`markdown(report)`), then the plots, if any;
    returns the plot files written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=indent))
    (out / "report.md").write_text(markdown(report))
    return list(plots(report, out) or []) if plots else []


def alternate(report: dict, rounds: int, children: dict[str, Callable[[], dict]], out: Path,
              markdown: Callable[[dict], str]) -> None:
    """Round after round, each child once in order (each a fresh process of its own, so that all see the
    same machine as it drifts): report["runs"] gets their results, then `uptime` after, then write_report."""
    for _ in range(rounds):
        for run in children.values():
            report["runs"].append(run())
            print(report["runs"][-1], file=sys.stderr)
    report["uptime_after"] = uptime()
    write_report(report, out, markdown)
    print(markdown(report))
