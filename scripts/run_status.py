"""OUT/status.json of `scripts/gpu_run.sh`: one entry per part, rewritten after each, so a run cut anywhere
still says what ran, for how long against its limit, and how it ended.

    run_status.py FILE start --dry-run 0|1 --total-limit S
    run_status.py FILE begin NAME --limit S
    run_status.py FILE part NAME --rc RC --seconds S --limit S [--report OUT/p8/paper.json]
    run_status.py FILE skip NAME --why TEXT
    run_status.py FILE end --rc RC --seconds S

A part's status: ok (exit 0), partial (exit 3: the table's deadline left points out, listed in its report),
timeout (124 or 137: the part's limit killed it; the table saves what it measured first), failed (any other
exit), skipped (not started: too little time left), running (begun, never ended: the run was killed).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

STATUS = {0: "ok", 3: "partial", 124: "timeout", 137: "timeout"}


def table_summary(path: Path) -> dict:
    """What a table part's report says it finished (its points, its stop), for the status line."""
    if not path.exists():
        return {"report": "none written"}
    rep = json.loads(path.read_text())
    shapes = {name: {"tau": r.get("tau", {}).get("tau"),
                     "check": "done" if "check" in r else ("cut" if "check_cut" in r else "not started"),
                     "points": sorted(r.get("bench", {})), "not_reached": [x["B"] for x in r.get("not_reached", [])]}
              for name, r in rep["shapes"].items()}
    return {"run_id": rep["run"]["id"], "shapes": shapes, **({"stopped": rep["stopped"]} if "stopped" in rep else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", type=Path)
    p.add_argument("event", choices=("start", "begin", "part", "skip", "end"))
    p.add_argument("name", nargs="?")
    p.add_argument("--rc", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--limit", type=float)
    p.add_argument("--total-limit", type=float)
    p.add_argument("--dry-run", type=int)
    p.add_argument("--report", type=Path)
    p.add_argument("--why")
    a = p.parse_args()
    doc = json.loads(a.file.read_text()) if a.file.exists() else {}
    now = time.time()
    if a.event == "start":
        doc = {"started_unix": now, "dry_run": bool(a.dry_run), "total_limit_s": a.total_limit,
               "cpus": os.cpu_count(), "parts": {}}
    elif a.event == "begin":
        doc["parts"][a.name] = {"status": "running", "limit_s": a.limit, "started_unix": now}
    elif a.event == "part":
        entry = doc["parts"].setdefault(a.name, {})
        # the load average: on a shared CPU a dry run's seconds are the machine's as much as the run's
        entry.update(status=STATUS.get(a.rc, "failed"), exit=a.rc, seconds=round(a.seconds, 1), limit_s=a.limit,
                     load_average=[round(x, 2) for x in os.getloadavg()])
        if a.report is not None:
            entry["table"] = table_summary(a.report)
    elif a.event == "skip":
        doc["parts"][a.name] = {"status": "skipped", "why": a.why}
    else:
        failed = [n for n, e in doc["parts"].items() if e["status"] in ("failed", "timeout", "running")]
        doc.update(exit=a.rc, seconds=round(a.seconds, 1), failed_parts=failed)
    tmp = a.file.with_name(f".{a.file.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(a.file)


if __name__ == "__main__":
    main()
