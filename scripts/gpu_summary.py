"""The summary of a `scripts/gpu_bench.sh` run, as markdown on stdout: `check` per model and policy,
tokens/s and the overhead over `fast` per policy and B, and margin's latency increment against dvr's
(the MarginGate paper reports dvr's increment 2.23x margin's).

    python scripts/gpu_summary.py results/gpu/<GPU name>
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PAPER_RATIO = 2.23  # LLM-42's increment over MarginGate's, in the paper


def check_lines(out: Path) -> list[str]:
    lines = ["## check (every run against the request alone under reference)", "",
             "| model | policy | sequence determinism | runs | token digest |", "|---|---|---|---|---|"]
    for path in sorted(out.glob("*/check-*.json")):
        r = json.loads(path.read_text())
        lines.append(f"| {path.parent.name} | {r['policy']} | {100 * r['sequence_determinism']:.1f} % | "
                     f"{r['runs']} | {r['tokens_sha256'][:16]} |")
    return lines


def bench_lines(out: Path) -> list[str]:
    lines = ["", "## bench (tokens/s; overhead over fast; margin's increment against dvr's)", "",
             "| model | B | policy | tokens/s | overhead over fast |", "|---|---|---|---|---|"]
    ratios = []
    for path in sorted(out.glob("*/bench/report.json")):
        model, report = path.parent.parent.name, json.loads(path.read_text())
        for batch, rows in report["main"].items():
            fast = rows["fast"]["tokens_per_s"]
            for policy, row in rows.items():
                lines.append(f"| {model} | {batch[1:]} | {policy} | {row['tokens_per_s']:.1f} | "
                             f"{100 * (fast / row['tokens_per_s'] - 1):+.1f} % |")
            if "margin" in rows and "dvr" in rows:
                margin = fast / rows["margin"]["tokens_per_s"] - 1
                dvr = fast / rows["dvr"]["tokens_per_s"] - 1
                ratio = f"{dvr / margin:.2f}x" if margin > 0 and dvr > 0 else "- (a policy no slower than fast)"
                ratios.append(f"| {model} | {batch[1:]} | {100 * margin:+.1f} % | {100 * dvr:+.1f} % | {ratio} |")
    lines += ["", f"dvr's increment over margin's (the paper: {PAPER_RATIO}x)", "",
              "| model | B | margin over fast | dvr over fast | dvr / margin |", "|---|---|---|---|---|", *ratios]
    return lines


def main(out: str) -> None:
    root = Path(out)
    machine = next((json.loads(p.read_text()).get("environment", {}) for p in root.glob("*/bench/report.json")), {})
    print(f"# GPU bench: {root.name}\n\ndevice {machine.get('device', '?')}, kernels {machine.get('kernels', '?')}, "
          f"torch {machine.get('torch', '?')}\n")
    print("\n".join(check_lines(root) + bench_lines(root)))


if __name__ == "__main__":
    main(sys.argv[1])
