"""The soak's memory record (scripts/soak.py): the server's VmRSS read from /proc at the phase marks and
sampled every few seconds, so growth shows as a plateau or a slope; its table rows and its PNG plot."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

FIELDS = ("VmRSS", "RssAnon", "RssFile")  # resident: all, anonymous (heaps, tensors), file-backed (libraries)


def status_kb(pid: int | None) -> dict[str, int]:
    """The FIELDS of /proc/PID/status, in KiB ({} without a pid or once the process is gone)."""
    if pid is None:
        return {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if k in FIELDS}


def rss_kb(pid: int | None) -> int | None:
    return status_kb(pid).get("VmRSS")


def growth_pct(rss: dict, key: str) -> float | None:
    """VmRSS at `key` over VmRSS after the alone-runs (the warm-up), in percent."""
    return round(100 * (rss[key] / rss["after_alone_runs"] - 1), 2) if rss[key] and rss["after_alone_runs"] else None


def memory_summary(memory: MemoryLog, rss: dict) -> dict:
    """The report's VmRSS figures: at the marks, the largest soak sample, growth over the warmed-up baseline
    (`rss_growth_pct_after_alone_runs`: to the end, the issue's figure)."""
    rss = {**rss, "max_during_soak": max((s[2] for s in memory.samples if s[1] == "soak"), default=None)}
    return {"rss_kb": rss, "rss_growth_pct_after_alone_runs": growth_pct(rss, "end"),
            "rss_growth_pct_at_idle": growth_pct(rss, "at_idle"),
            "rss_growth_pct_max_during_soak": growth_pct(rss, "max_during_soak")}


def memory_rows(report: dict) -> list[tuple[str, str]]:
    """The markdown table's VmRSS rows."""
    rss, idle = report["rss_kb"], report["config"]["idle_s"]
    mib = {k: "-" if v is None else f"{v / 1024:.1f}" for k, v in rss.items()}
    return [(f"VmRSS start / after the alone-runs and {idle:g} s idle / end ({idle:g} s idle after the soak) (MiB)",
             f"{mib['start']} / {mib['after_alone_runs']} / {mib['end']}"),
            ("VmRSS growth after the alone-runs, to the end", f"**{report['rss_growth_pct_after_alone_runs']} %**"),
            ("VmRSS largest soak sample / once idle (MiB, growth)",
             f"{mib['max_during_soak']} ({report['rss_growth_pct_max_during_soak']} %) / {mib['at_idle']} "
             f"({report['rss_growth_pct_at_idle']} %)"),
            ("VmRSS slope over the soak's second half (MiB / minute)",
             report["rss_samples"]["soak"].get("second_half_slope_mib_per_min")),
            ("server: prefix cache positions, idle heap trims (after alone-runs -> end)",
             " -> ".join(str({k: int(v) for k, v in g.items()}) for g in report["server_metrics"].values()))]


class MemoryLog:
    """VmRSS (and its anonymous and file parts) every `every_s` seconds from `start`, plus the phase marks."""

    def __init__(self, pid: int | None, every_s: float):
        self.pid, self.every_s = pid, every_s
        self.t0 = time.monotonic()
        self.samples: list[list] = []     # [seconds since start, phase, VmRSS, RssAnon, RssFile] (KiB)
        self.marks: dict[str, float] = {}  # phase -> seconds since start when it began
        self.phase = "start"

    def sample(self) -> int | None:
        now = status_kb(self.pid)
        if now:
            self.samples.append([round(time.monotonic() - self.t0, 1), self.phase, *(now.get(f) for f in FIELDS)])
        return now.get("VmRSS")

    def mark(self, phase: str) -> int | None:
        """A phase begins: one sample now; the VmRSS at that point (KiB)."""
        self.phase = phase
        self.marks[phase] = round(time.monotonic() - self.t0, 1)
        return self.sample()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except asyncio.TimeoutError:
                pass

    def soak_slope(self) -> dict:
        """VmRSS over the soak phase: its first, largest and last sample, and the least-squares slope of the
        second half (MiB per minute): near 0 is a plateau, a steady slope a leak."""
        soak = [s for s in self.samples if s[1] == "soak"]
        if len(soak) < 4:
            return {}
        half = soak[len(soak) // 2:]
        n, xs, ys = len(half), [s[0] / 60 for s in half], [s[2] / 1024 for s in half]
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return {"first_mib": round(soak[0][2] / 1024, 1), "max_mib": round(max(s[2] for s in soak) / 1024, 1),
                "last_mib": round(soak[-1][2] / 1024, 1), "second_half_slope_mib_per_min": round(slope, 3)}

    def report(self) -> dict:
        return {"every_s": self.every_s, "columns": ["seconds", "phase", *(f"{f}_kb" for f in FIELDS)],
                "marks_s": self.marks, "soak": self.soak_slope(), "samples": self.samples}

    def plot(self, path: Path, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.samples:
            return
        fig, ax = plt.subplots(figsize=(8, 4))
        t = [s[0] / 60 for s in self.samples]
        for col, name in ((2, "VmRSS"), (3, "RssAnon")):
            ax.plot(t, [(s[col] or 0) / 1024 for s in self.samples], label=name, lw=1.2)
        for phase, at in self.marks.items():
            ax.axvline(at / 60, color="grey", ls=":", lw=0.8)
            ax.text(at / 60, ax.get_ylim()[1], f" {phase}", va="top", fontsize=7, rotation=90, color="grey")
        ax.set_xlabel("minutes since the server answered /health")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=9)
        ax.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def curve_table(samples: list[list], rows: int = 13) -> list[str]:
    """Markdown lines: about `rows` evenly spaced samples (and the last) of a MemoryLog's report."""
    picked = [samples[round(i * (len(samples) - 1) / (rows - 1))] for i in range(rows)] \
        if len(samples) > rows else samples
    return ["| seconds | phase | VmRSS MiB | RssAnon MiB |", "|---:|---|---:|---:|",
            *(f"| {p[0]:.0f} | {p[1]} | {p[2] / 1024:.1f} | {(p[3] or 0) / 1024:.1f} |" for p in picked)]
