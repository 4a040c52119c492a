"""`margingate bench-spec`: what speculative decoding buys, and where it stops paying.

Two measurements, one run, same threads:
- decode: B = 1 on prompts that ask to repeat or edit a given text or code, each decoded plain and
  with each proposer (`batch-invariant`): ms per output token, acceptance rate, mean accepted
  length, and whether the tokens are bitwise the plain ones;
- batched: B requests of those prompts at once, plain, with every proposal fed, and with the step
  cost model deciding (`engine/step_profile.py`): tokens per second and equality;
- pass cost: the time of a forward where each of B requests feeds k + 1 rows (its span of a
  speculative step) against one row each, for k = 1..K: the ceiling speculation can reach at
  that size is (k + 1) / cost ratio, with every proposal accepted.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from .. import cli_args
from ..analysis.outputs import machine_line, write_report
from ..data.prompts import Prompt
from ..engine import Request
from ..options import SpeculativeConfig

CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)
'''
TEXT = ("The committee met on Tuesday to review the budget. It approved the new library wing, "
        "postponed the road repairs to spring, and asked the treasurer for a revised forecast by March.")
COPYING = [
    f"Repeat this code exactly:\n{CODE}",
    f"Rename the function mean to average everywhere in this code and print the whole code:\n{CODE}",
    f"Add type hints to this code and print the whole code:\n{CODE}",
    f"Repeat this paragraph word for word:\n{TEXT}",
    f"Rewrite this paragraph, replacing Tuesday with Friday and nothing else:\n{TEXT}",
    f"Quote the second sentence of this paragraph, then summarize the paragraph:\n{TEXT}",
]


def encode(llm, prompts: list[str]) -> list[list[int]]:
    return [llm.tokenizer.encode_prompt(Prompt("chat", ({"role": "user", "content": text},), None, f"spec:{i}"))
            for i, text in enumerate(prompts)]


def decode_rows(llm, prompts: list[str], methods: list[SpeculativeConfig | None], tokens: int) -> list[dict]:
    """Each prompt alone (B = 1), plain and with each config: ms/token and the speculation stats."""
    rows = []
    for i, ids in enumerate(tqdm(encode(llm, prompts), desc="prompts", leave=False)):
        plain = None
        for spec in methods:
            req = Request(ids, tokens, llm.policy("batch-invariant"), request_id=f"b{i}", speculative=spec)
            t = time.perf_counter()
            res = llm.engine.generate([req])[0]
            seconds = time.perf_counter() - t
            plain = plain or res.token_ids
            rows.append({"prompt": i, "method": spec.method if spec else "plain", "k": spec.num_tokens if spec else 0,
                         "tokens": len(res.token_ids), "ms_per_token": 1000 * seconds / max(1, len(res.token_ids)),
                         "same_tokens": res.token_ids == plain,
                         **{key: res.stats.get(key) for key in ("acceptance_rate", "mean_accepted_length",
                                                                 "proposed_tokens", "accepted_tokens")}})
    return rows


def batched_rows(llm, prompts: list[str], batch: int, spec: SpeculativeConfig, tokens: int) -> list[dict]:
    """B requests at once (the prompts cycled), plain, with every proposal fed, and with the step cost
    model deciding: output tokens per second, and whether each request's tokens are the plain ones."""
    engine, config = llm.engine, llm.engine.config
    ids = encode(llm, prompts)
    ids = [ids[i % len(ids)] for i in range(batch)]
    rows, plain = [], None
    for mode in tqdm(("plain", "every proposal", "cost model"), desc=f"B = {batch}", leave=False):
        engine.config = dataclasses.replace(config, speculative_cost_model=mode == "cost model")
        reqs = [Request(x, tokens, llm.policy("batch-invariant"), request_id=f"m{i}",
                        speculative=None if mode == "plain" else spec) for i, x in enumerate(ids)]
        t = time.perf_counter()
        results = engine.generate(reqs)
        seconds = time.perf_counter() - t
        plain = plain or [r.token_ids for r in results]
        stats = [r.stats for r in results]
        rows.append({"batch_size": batch, "mode": mode, "k": 0 if mode == "plain" else spec.num_tokens,
                     "tokens_per_second": sum(len(r.token_ids) for r in results) / seconds,
                     "proposed_tokens": sum(s.get("proposed_tokens", 0) for s in stats),
                     "accepted_tokens": sum(s.get("accepted_tokens", 0) for s in stats),
                     "held_steps": sum(s.get("speculation_held_steps", 0) for s in stats),
                     "bitwise_same": f"{sum(r.token_ids == p for r, p in zip(results, plain))}/{batch}"})
    engine.config = config
    return rows


def pass_cost(llm, batch_sizes: list[int], max_k: int, repeats: int, context: int) -> list[dict]:
    """Median time of a forward with B spans of k + 1 rows each (exact attention, invariant kernels)
    over `context` positions of K/V, against k = 0."""
    import torch  # with the runner: only when the command runs, not on the import of the CLI (--help)

    from ..engine.runner import Span
    from ..kernels.choice import KernelChoice

    engine = llm.engine
    seqs = []
    for i in range(max(batch_sizes)):
        seq = engine.add_request(Request([1 + (7 * i + j) % 1000 for j in range(context)], 1, llm.policy("fast"),
                                         request_id=f"cost{i}"))
        seqs.append(seq)
    engine.scheduler.admit()
    for seq in seqs:
        seq.output_ids = [5] * (max_k + 1)  # tokens for the spans; their K/V are written by the passes
    rows = []
    try:
        for b in batch_sizes:
            base = None
            for k in tqdm(range(max_k + 1), desc=f"pass cost B={b}", leave=False):
                spans = [Span(s, context - 1, context + k, exact_attention=True, kernel_choice=KernelChoice.INVARIANT,
                              logits_rows=k + 1) for s in seqs[:b]]
                times = []
                for _ in range(repeats + 1):
                    t = time.perf_counter()
                    engine.runner.forward(spans, torch.bfloat16, KernelChoice.INVARIANT)
                    times.append(time.perf_counter() - t)
                med = statistics.median(times[1:])
                base = base or med
                rows.append({"batch_size": b, "k": k, "rows": b * (k + 1), "median_ms": 1000 * med,
                             "cost_ratio": med / base, "ceiling_speedup": (k + 1) * base / med})
    finally:
        for seq in seqs:
            engine.abort(seq.request_id)
        engine.step()
    return rows


def llamacpp_rows(llm, folder: Path, prompts: list[str], ks: list[int], tokens: int, repeats: int) -> dict:
    """llama.cpp's prompt-lookup decoding on the same prompt ids, alone, plain and at each k
    (`llamacpp_lookup_worker.py`): ms/token, and whether its tokens are its own plain tokens."""
    from ..peers import LlamaCppPeer, run_worker

    peer = LlamaCppPeer(folder, llm.engine.num_threads)
    data = run_worker(peer.python, "llamacpp_lookup_worker.py", {
        "gguf": str(peer.gguf), "threads": peer.threads, "prompt_ids": encode(llm, prompts), "max_new_tokens": tokens,
        "k": ks, "repeats": repeats}, peer.env(), "llamacpp")
    plain = {r["prompt"]: r["tokens"] for r in data["rows"] if r["k"] == 0}
    rows = [{"prompt": r["prompt"], "method": "plain" if r["k"] == 0 else "llama.cpp lookup", "k": r["k"],
             "tokens": len(r["tokens"]), "ms_per_token": 1000 * r["seconds"] / len(r["tokens"]),
             "same_tokens": r["tokens"] == plain[r["prompt"]], "acceptance_rate": None, "mean_accepted_length": None}
            for r in data["rows"]]
    return {"version": data["version"], **peer.facts(), "rows": rows, "summary": summary(rows)}


def summary(rows: list[dict]) -> list[dict]:
    """Per method: median ms/token over the prompts, its ratio to plain, acceptance, equality."""
    out = []
    methods = dict.fromkeys((r["method"], r["k"]) for r in rows)
    plain = {r["prompt"]: r["ms_per_token"] for r in rows if r["method"] == "plain"}
    for method, k in methods:
        mine = [r for r in rows if (r["method"], r["k"]) == (method, k)]
        speedups = [plain[r["prompt"]] / r["ms_per_token"] for r in mine]
        rates = [r["acceptance_rate"] for r in mine if r["acceptance_rate"] is not None]
        lengths = [r["mean_accepted_length"] for r in mine if r["mean_accepted_length"] is not None]
        out.append({"method": method, "k": k, "median_ms_per_token": statistics.median(r["ms_per_token"] for r in mine),
                    "median_speedup": statistics.median(speedups),
                    "acceptance_rate": statistics.median(rates) if rates else None,
                    "mean_accepted_length": statistics.median(lengths) if lengths else None,
                    "bitwise_same": f"{sum(r['same_tokens'] for r in mine)}/{len(mine)}"})
    return out


def markdown(report: dict) -> str:
    lines = [f"# Speculative decoding: {report['model']}", "", f"Machine: {report['machine']}", "",
             f"## Decode, B = 1, batch-invariant, {len(COPYING)} repeat / edit prompts, "
             f"{report['max_new_tokens']} new tokens", "",
             "| method | k | ms/token (median) | speed-up vs plain (median) | acceptance | accepted per step | "
             "tokens bitwise plain |", "|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        rate = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"
        length = "-" if s["mean_accepted_length"] is None else f"{s['mean_accepted_length']:.2f}"
        lines.append(f"| {s['method']} | {s['k']} | {s['median_ms_per_token']:.1f} | {s['median_speedup']:.2f}x | "
                     f"{rate} | {length} | {s['bitwise_same']} |")
    if report.get("llamacpp"):
        peer = report["llamacpp"]
        lines += ["", f"## llama.cpp's prompt lookup (llama-cpp-python {peer['version']}), same prompt ids, B = 1",
                  "", peer["weights"], "", "| method | k | ms/token (median) | speed-up vs its plain (median) | "
                  "tokens bitwise its plain |", "|---|---|---|---|---|"]
        for s in peer["summary"]:
            lines.append(f"| {s['method']} | {s['k']} | {s['median_ms_per_token']:.1f} | {s['median_speedup']:.2f}x | "
                         f"{s['bitwise_same']} |")
    if report.get("batched"):
        lines += ["", f"## B = {report['batched'][0]['batch_size']} at once, batch-invariant", "",
                  "| mode | k | tokens/s | vs plain | proposed | accepted | held steps | tokens bitwise plain |",
                  "|---|---|---|---|---|---|---|---|"]
        base = report["batched"][0]["tokens_per_second"]
        for r in report["batched"]:
            lines.append(f"| {r['mode']} | {r['k']} | {r['tokens_per_second']:.1f} | "
                         f"{r['tokens_per_second'] / base:.2f}x | {r['proposed_tokens']} | {r['accepted_tokens']} | "
                         f"{r['held_steps']} | {r['bitwise_same']} |")
    if report.get("pass_cost"):
        lines += ["", f"## Pass cost ({report['pass_cost_model']}, {report['context']} positions of context)", "",
                  "k + 1 rows per request against 1; ceiling = (k + 1) / cost ratio, every proposal accepted.", "",
                  "| B | k | rows | ms | cost ratio | ceiling speed-up |", "|---|---|---|---|---|---|"]
        for r in report["pass_cost"]:
            lines.append(f"| {r['batch_size']} | {r['k']} | {r['rows']} | {r['median_ms']:.1f} | "
                         f"{r['cost_ratio']:.2f} | {r['ceiling_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plots(report: dict, out: Path) -> list[Path]:
    from ..analysis.plots import _plt, _save

    if not report.get("pass_cost"):
        return []
    fig, ax = _plt().subplots(figsize=(6, 3.6))
    for b in dict.fromkeys(r["batch_size"] for r in report["pass_cost"]):
        mine = [r for r in report["pass_cost"] if r["batch_size"] == b]
        ax.plot([r["k"] for r in mine], [r["ceiling_speedup"] for r in mine], marker="o", label=f"B = {b}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="proposals per request (k)", ylabel="ceiling speed-up, all accepted",
           title=f"Speculation's ceiling: {report['pass_cost_model']}")
    ax.legend()
    return [_save(fig, out / "pass_cost.png")]


def _cmd(args) -> None:
    llm = cli_args.llm(args, max(*args.batch_sizes, args.batched))
    methods = [None, *(SpeculativeConfig("ngram", k) for k in args.k)]
    if args.draft_model:
        methods += [SpeculativeConfig("draft", k) for k in args.k]
    rows = decode_rows(llm, COPYING, methods, args.max_new_tokens)
    report = {"model": args.model, "max_new_tokens": args.max_new_tokens, "machine": machine_line(llm.environment()),
              "environment": llm.environment(), "rows": rows, "summary": summary(rows)}
    if "llamacpp" in args.peers:
        report["llamacpp"] = llamacpp_rows(llm, llm.weights_folder(), COPYING, args.k, args.max_new_tokens,
                                           args.repeats)
    if args.batched:
        report["batched"] = batched_rows(llm, COPYING, args.batched, SpeculativeConfig("ngram", max(args.k)),
                                         args.max_new_tokens)
    if args.pass_cost_model:
        if args.pass_cost_model != args.model:
            other = argparse.Namespace(**{**vars(args), "model": args.pass_cost_model, "draft_model": None})
            llm = cli_args.llm(other, max(args.batch_sizes))
        report.update(pass_cost_model=args.pass_cost_model, context=args.context,
                      pass_cost=pass_cost(llm, args.batch_sizes, args.max_k, args.repeats, args.context))
    write_report(report, Path(args.out), markdown, plots)
    print(markdown(report))


def _peers(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    if set(names) - {"llamacpp"}:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(sorted(set(names) - {'llamacpp'}))}: "
                                         "bench-spec compares with llamacpp (llama.cpp's prompt lookup)")
    return names


def add_parser(sub) -> None:
    p = sub.add_parser("bench-spec", help="speculative decoding: ms/token at B = 1 and the cost of k + 1-row passes")
    p.add_argument("--k", type=cli_args.int_list, default=[2, 4, 8], help="proposals per step to try")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=96)
    p.add_argument("--pass-cost-model", default=None, metavar="MODEL",
                   help="also time k + 1-row passes on this model (e.g. a random 1B folder)")
    p.add_argument("--batched", type=int, default=16, metavar="B",
                   help="also decode B requests at once: plain, every proposal fed, the step cost model (0: skip)")
    p.add_argument("--batch-sizes", type=cli_args.int_list, default=[1, 4, 16], help="pass cost batch sizes")
    p.add_argument("--max-k", type=cli_args.positive_int, default=8)
    p.add_argument("--context", type=cli_args.positive_int, default=256)
    p.add_argument("--repeats", type=cli_args.positive_int, default=5)
    p.add_argument("--peers", type=_peers, default=[],
                   help="llamacpp: also llama.cpp's prompt-lookup decoding on the same prompts (`make llamacpp-venv`)")
    p.add_argument("--out", default="results/bench-spec")
    cli_args.add_draft_model_arg(p)
    cli_args.add_model_args(p)
    p.set_defaults(func=_cmd)
