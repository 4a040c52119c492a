"""Our bf16 forward against transformers' fp32 and bf16 forwards, per architecture, over 1,024 positions
(the models and the measure of tests/test_each_architecture.py). Writes table.json and table.md here.

    .venv/bin/python results/models/bf16-numerics/run.py
"""
from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from tests.test_each_architecture import ARCHITECTURES, POSITIONS, _errors  # noqa: E402


def main() -> None:
    rows = []
    quarter = POSITIONS // 4
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARCHITECTURES:
            ours, theirs = _errors(name, Path(tmp))
            rows.append({"architecture": name, "ours_mean": float(ours.mean()), "ours_max": float(ours.max()),
                         "ours_first_quarter": float(ours[:quarter].mean()),
                         "ours_last_quarter": float(ours[-quarter:].mean()), "hf_bf16_mean": float(theirs.mean()),
                         "hf_bf16_first_quarter": float(theirs[:quarter].mean()),
                         "hf_bf16_last_quarter": float(theirs[-quarter:].mean())})
            print(rows[-1], flush=True)
    (HERE / "table.json").write_text(json.dumps({"positions": POSITIONS, "cpu": platform.processor() or "x86_64",
                                                  "rows": rows}, indent=1) + "\n")
    lines = [f"Mean |logprob - transformers fp32| over the vocabulary, {POSITIONS} positions "
             "(first quarter -> last quarter)", "",
             "| architecture | ours (bf16) | transformers bf16 | ours / theirs |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['architecture']} | {r['ours_mean']:.4f} ({r['ours_first_quarter']:.4f} -> "
                     f"{r['ours_last_quarter']:.4f}) | {r['hf_bf16_mean']:.4f} ({r['hf_bf16_first_quarter']:.4f} -> "
                     f"{r['hf_bf16_last_quarter']:.4f}) | {r['ours_mean'] / r['hf_bf16_mean']:.2f} |")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
