"""The table's report on disk: saved after every part and point, resumed, and cut short loudly.

A lent GPU gives one call of a few minutes: whatever was measured when the part's time runs out must be on
disk. The report is rewritten (atomically) after each part, so a kill loses at most the point in progress;
a deadline (`Clock`) stops the run between points and says which were not reached; SIGTERM (the outer
`timeout`) raises `HardStop`, which `Exception` handlers do not catch, and the report records it.

Every file under the output folder is this run's: `--resume` reads an earlier report of the same folder,
keeps what it finished (each part says which run measured it) and writes the folder anew.
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path


class HardStop(BaseException):
    """SIGTERM arrived: stop where we are, save, exit."""


STOPPED: list[int] = []  # the signal received, if one was


def stop_on_sigterm() -> None:
    def handler(signum, frame):
        STOPPED.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the save that follows
        raise HardStop(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def hard_stop_of(exc: BaseException) -> HardStop | None:
    """`exc` as the hard stop it is: HardStop itself, or whatever it turned into (raised inside an import or a
    C extension, it may surface as another exception) once SIGTERM has arrived."""
    if isinstance(exc, HardStop):
        return exc
    return HardStop(f"signal {STOPPED[0]} (surfacing as {type(exc).__name__})") if STOPPED else None


class Clock:
    """Seconds since the process started its work, against the part's deadline (None: none)."""

    def __init__(self, deadline_s: float | None):
        self.t0, self.deadline_s = time.monotonic(), deadline_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return float("inf") if self.deadline_s is None else self.deadline_s - self.elapsed()


class Store:
    """`paper.json` and `paper.md` under `out`, with the run's identity and the files it wrote."""

    def __init__(self, out: Path, report: dict, markdown: Callable[[dict], str], resume: bool):
        self.out, self.markdown = out, markdown
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        earlier = self._earlier() if resume else None
        self.report = report
        self.report["run"] = {"id": self.run_id, "started_unix": time.time(), "pid": os.getpid(),
                              "resumed_from": [], "files": ["paper.json", "paper.md"]}
        if earlier is not None:
            self.report["shapes"] = earlier.get("shapes", {})
            self.report["run"]["resumed_from"] = [*earlier["run"].get("resumed_from", []), earlier["run"]["id"]]
        elif out.exists() and any(out.iterdir()):
            raise SystemExit(f"{out} is not empty: a fresh run writes a fresh folder (or pass --resume)")

    def _earlier(self) -> dict | None:
        path = self.out / "paper.json"
        return json.loads(path.read_text()) if path.exists() else None

    def stamp(self, part: dict) -> dict:
        """A finished part, marked with the run that measured it."""
        part["run_id"] = self.run_id
        return part

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.report["run"]["saved_unix"] = time.time()
        for name, text in (("paper.json", json.dumps(self.report, indent=2)), ("paper.md", self.markdown(self.report))):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(self.out / name)
