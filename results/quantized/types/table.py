"""Issue 64's per-type table: every GGUF type, kept quantized or not, its digest on each int8 path (digests.json)
and B = 1 decode against llama.cpp on a 1B file of that type (the bench runs `bench.sh` leaves in 1b-FILE-b1/:
decode-only tok/s of `batch-invariant` and of llama.cpp in the same run, medians of 3, and what the run kept
each matrix group as). Two ratios: of the decode-only medians, and of each contender's best end-to-end run
(prefill included): on a 2-core machine shared with other jobs one stalled run moves a median of 3, the best
run much less. Writes types.json and types.md beside this script.

    python results/quantized/types/table.py
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
# type -> (kept under auto, kept under exact, stored bits per weight (the file's), the 1B file that stands for it)
TYPES = {
    "Q8_0": ("kept", "kept", "8.5 (8.5)", "q8_0"), "Q4_0": ("kept", "kept", "4.5 (4.5)", "q4_0"),
    "Q4_1": ("kept", "kept", "5 (5)", "q4_1"), "Q5_0": ("kept", "kept", "5.5 (5.5)", "q5_0"),
    "Q5_1": ("kept", "kept", "6 (6)", "q5_1"), "Q4_K": ("kept", "kept", "4.625 (4.5)", "q4_k_m"),
    "Q5_K": ("kept", "kept", "5.625 (5.5)", "q5_k_m"), "Q6_K": ("kept", "kept", "6.5625 (6.5625)", "q6_k"),
    "Q2_K": ("kept", "bf16", "3.125 (2.625)", "q2_k"), "Q3_K": ("kept", "bf16", "3.5625 (3.4375)", "q3_k_m"),
    "IQ4_NL": ("kept", "bf16", "4.5 (4.5)", "iq4_nl"), "IQ4_XS": ("kept", "bf16", "4.3125 (4.25)", "iq4_xs"),
    "MXFP4": ("kept (table)", "kept (Q5_0-shaped)", "4.5 (4.25); exact 5.5", None),
    "IQ3_XXS": ("kept (re-coded)", "bf16", "4.3125 (3.0625)", "iq3_xxs"),
    "IQ3_S": ("kept (re-coded)", "kept (Q5_0-shaped)", "4.3125 (3.4375)", "iq3_s"),
    "IQ2_XXS": ("kept (re-coded)", "bf16", "3.3125 (2.0625)", "iq2_xxs"),
    "IQ2_XS": ("kept (re-coded)", "bf16", "3.5625 (2.3125)", "iq2_xs"),
    "IQ2_S": ("kept (re-coded)", "bf16", "3.5625 (2.5625)", "iq2_s"),
    "IQ1_S": ("kept (re-coded)", "bf16", "3.3125 (1.5625)", "iq1_s"),
    "IQ1_M": ("kept (re-coded)", "bf16", "3.5625 (1.75)", "iq1_m"),
}
POLICY, PEER = "batch-invariant", "llama.cpp"


def b1(file: str | None) -> dict | None:
    path = HERE / f"1b-{file}-b1" / "report.json"
    if file is None or not path.exists():
        return None
    r = json.loads(path.read_text())
    row = r["main"]["B1"]
    ours, peer = row[POLICY]["decode_tokens_per_s"], row[PEER]["decode_tokens_per_s"]
    return {"file": f"random-1b.{file}.gguf", "ours_tok_s": ours, "llamacpp_tok_s": peer, "ratio": ours / peer,
            "best_run_ratio": row[PEER]["seconds_min"] / row[POLICY]["seconds_min"],
            "ours_end_to_end_s": row[POLICY]["seconds_median"], "llamacpp_end_to_end_s": row[PEER]["seconds_median"],
            "kept_as": r["environment"]["weights"], "int8_path": r["environment"]["kernels_int8_path"]}


def main() -> None:
    digests = json.loads((HERE / "digests.json").read_text())
    paths = list(next(iter(digests["digests"].values())))
    rows = []
    for name, (auto, exact, bits, file) in TYPES.items():
        d = digests["digests"].get(name, {})
        rows.append({"type": name, "auto": auto, "exact": exact, "bits": bits, "digests": d, "b1": b1(file)})
    (HERE / "types.json").write_text(json.dumps({"cpu": digests["cpu"], "paths": digests["paths"], "rows": rows},
                                                indent=1))
    head = ["type", "`auto` (int8)", "`exact`", "bits / weight (file's)", *paths, "1B file", "B = 1 decode tok/s, "
            f"{POLICY} / llama.cpp", "ratio (medians)", "ratio (best runs)"]
    lines = [f"CPU: {digests['cpu']}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"`{r['digests'][p]}`" if p in r["digests"] else "" for p in paths]
        m = r["b1"]
        speed = [m["file"], f"{m['ours_tok_s']:.1f} / {m['llamacpp_tok_s']:.1f}", f"{m['ratio']:.2f}x",
                 f"**{m['best_run_ratio']:.2f}x**"] if m else ["", "", "", ""]
        lines.append("| " + " | ".join([r["type"], r["auto"], r["exact"], r["bits"], *cells, *speed]) + " |")
    (HERE / "types.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
