"""The table as markdown, from the report (`paper.json`)."""
from __future__ import annotations

from .protocol import DETERMINISTIC

# the paper (Llama-3.1-8B, Qwen2.5-14B): dvr's latency increase over margin's, and margin's trigger rate
PAPER = {"llama-3.1-8b": (2.23, 0.1856), "qwen2.5-14b": (1.99, 0.1505)}
POLICY_ORDER = ("fast", "batch-invariant", "margin", "dvr", "verify-all")


def percent(x, signed: bool = True) -> str:
    return "-" if x is None else (f"{100 * x:+.1f} %" if signed else f"{100 * x:.1f} %")


def header(rep: dict) -> list[str]:
    dry = " (Triton's interpreter on CPU: the timings say nothing about a GPU)" if rep["device"] == "dry-run-cpu" \
        else ""
    s = rep["settings"]
    lines = [f"# The paper's table: {rep['device']}{dry}", "",
             f"torch {rep['torch']}, copy bandwidth {rep['bandwidth_GBps']:.0f} GB/s; {s['new']} new tokens per "
             f"request (dvr: W {s['window']}, G {s['group']}), prompts of {s['prompt_len'][0]}-{s['prompt_len'][1]} "
             f"tokens, random bf16 weights; per point {s['warmup']} warm-up run(s), then {s['repeats']} timed; "
             f"run {rep['run']['id']}" + (f", resuming {', '.join(rep['run']['resumed_from'])}"
                                          if rep["run"]["resumed_from"] else "")]
    if "stopped" in rep:
        lines += ["", f"**Stopped early** ({rep['stopped']['by']}, after {rep['stopped']['after_s']:.0f} s): "
                      "what follows is what was measured."]
    return lines


def tau_lines(t: dict) -> list[str]:
    q = "" if t["qualified"] else " **(no point qualified: the largest swept is used, unqualified)**"
    lines = [f"tau **{t['tau']:.4g}**{q}: {t['rule']}; {len(t['prompts'])} calibration prompts (none checked or "
             f"timed), B = {', '.join(map(str, t['batch_sizes']))}, {t['new']} new tokens; {t['flips']} flips "
             f"under fast; criterion: {t['criterion']}", "", "| tau | seq. det. | missed flips | trigger rate |",
             "|---|---|---|---|"]
    lines += [f"| {r['tau']:.4g} | {percent(r['sequence_determinism'], False)} | {r['missed_flips']} | "
              f"{percent(r['trigger_rate'], False)} |" for r in t["frontier"]]
    return lines


def check_lines(c: dict) -> list[str]:
    lines = ["", f"check: {len(c['prompts'])} prompts joining two per step, against each alone under "
                 f"batch-invariant (digest {c['alone']['digest']})", "",
             "| policy | sequence determinism | digest | graphs |", "|---|---|---|---|"]
    for p, r in c["policies"].items():
        if "skipped" in r:
            lines.append(f"| {p} | {r['skipped']} | | |")
            continue
        lines.append(f"| {p} | {percent(r['sequence_determinism'], False)} | {r['digest']} | {graphs_of(r)} |")
    return lines


def graphs_of(r: dict) -> str:
    return f"{r['graphs']} ({r['recorded_shapes']} shapes)" + (f"; {r['note']}" if r.get("note") else "")


def bench_lines(bench: dict) -> list[str]:
    lines = ["", "decode ms / step: median over the timed runs (min-max); prefill timed apart", "",
             "| B | policy | decode ms / step | prefill ms | increase over fast | trigger rate | digests | graphs |",
             "|---|---|---|---|---|---|---|---|"]
    for b, row in bench.items():
        for p in POLICY_ORDER:
            x = row["policies"].get(p, {})
            if "decode_ms_per_step" not in x:
                lines.append(f"| {b[1:]} | {p} | {x.get('error') or x.get('skipped') or '-'} | | | | | |")
                continue
            d, pre = x["decode_ms_per_step"], x["prefill_ms"]
            trig = percent(x["trigger_rate"], False) if p in ("margin", "dvr") else ""
            lines.append(f"| {b[1:]} | {p} | {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}) | {pre['median']:.1f} "
                         f"| {percent(x.get('increase'))} | {trig} | {', '.join(x['digests'])} | {graphs_of(x)} |")
    return lines


def ratio_lines(name: str, bench: dict) -> list[str]:
    paper = PAPER.get(name)
    said = f" (the paper: {paper[0]}x, margin triggering {percent(paper[1], False)})" if paper else ""
    lines = ["", f"dvr's increase over fast / margin's{said}", "", "| B | margin | dvr | dvr / margin |",
             "|---|---|---|---|"]
    for b, row in bench.items():
        m, d = (row["policies"].get(p, {}).get("increase") for p in ("margin", "dvr"))
        ratio = f"{d / m:.2f}x" if m and d is not None and m > 0 else "- (margin no slower than fast)"
        lines.append(f"| {b[1:]} | {percent(m)} | {percent(d)} | {ratio} |")
    return lines


def one_digest(r: dict) -> str:
    """Do the deterministic policies agree, in the check and in every timed run?"""
    got = {r["check"]["policies"][p]["digest"] for p in DETERMINISTIC if p in r.get("check", {}).get("policies", {})}
    return "one digest" if len(got) == 1 else f"{len(got)} digests: {sorted(got)}"


def markdown(rep: dict) -> str:
    lines = header(rep)
    for name, r in rep["shapes"].items():
        lines += ["", f"## {name}", ""]
        if "tau" in r:
            lines += tau_lines(r["tau"])
        if "check" in r:
            lines += check_lines(r["check"]) + ["", f"deterministic policies in the check: {one_digest(r)}"]
        elif "check_cut" in r:
            lines += check_lines(r["check_cut"]) + ["", "the check was cut by the part's deadline"]
        if r.get("bench"):
            lines += bench_lines(r["bench"]) + ratio_lines(name, r["bench"])
        lines += [f"- B = {x['B']} not reached: {x['why']}" for x in r.get("not_reached", [])]
    return "\n".join(lines) + "\n"
