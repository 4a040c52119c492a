"""`margingate bench`: what does determinism cost, policy by policy, measured together.

One workload (prompts, output length, batch size) runs under every policy in the
same process, interleaved repetition by repetition so machine noise hits all of
them alike. Every request decodes exactly `max_new_tokens` (EOS ignored), so
all policies do the same amount of work; each output is compared with the
reference (each prompt decoded alone by the verifier) for sequence determinism.
Peers (`--peers hf,vllm,llamacpp`, see peers.py) run the same prompt ids and lengths in the
same run; they are judged against themselves decoding each prompt alone.
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from .. import cli_args
from ..analysis import compare, plots
from ..analysis.outputs import machine_line, percent, rss_mb, write_report
from ..analysis.passes import format_profile, pass_profile
from ..analysis.roofline import StepCost, format_roofline, measure, roofline
from ..analysis.runs import CachedRuns
from ..analysis.step_profile import decode_roofline, format_decode_roofline
from ..environment import kept_quantized
from ..options import PolicySpec
from ..peers import PEERS, make_peers

if TYPE_CHECKING:  # the facade loads the model stack: only when the command runs
    from ..llm import LLM

# variant name -> the policy "protected" requests get; the rest run UNPROTECTED.
VARIANTS = {
    "fast": PolicySpec("fast"),
    "fast-library": PolicySpec("fast-library"),  # the same without our kernels: what they buy
    "batch-invariant": PolicySpec("batch-invariant"),
    "batch-invariant-global": PolicySpec("batch-invariant"),  # every request of the batch, protected or not
    "layercast": PolicySpec("layercast"),
    "dvr": PolicySpec("dvr"),
    "verify-all": PolicySpec("verify-all"),
    "margin": PolicySpec("margin"),
    "margin-eager": PolicySpec("margin", defer=0),  # each near-tie verified at its own step
    "margin-column": PolicySpec("margin", repair="column"),
}
DEFAULT_VARIANTS = list(VARIANTS)
PROTECT_ALL = frozenset({"batch-invariant-global"})  # variants whose policy every request gets
UNPROTECTED = PolicySpec("fast")
BASELINE = "fast"                     # the variant overheads are measured against
MARGIN = "margin"                     # the variant latency increments are compared with ...
INCREMENT_OVER_MARGIN = ("dvr", "verify-all")  # ... for these
SWEEP_VARIANTS = ("fast", "margin", "dvr", "verify-all", "batch-invariant")  # the protected-share sweep
#: a run's figures over its protected requests (`sequence_determinism` against the reference)
GATE_FIGURES = ("decode_steps", "trigger_rate", "repair_rate", "replayed_tokens", "rollbacks", "discarded_tokens")
RUN_FIGURES = ("sequence_determinism", "diverged", "protected_requests", *GATE_FIGURES)


@dataclass
class Workload:
    prompt_ids: list[list[int]]
    max_new_tokens: int
    batch_size: int
    protected: float = 1.0  # share of requests that get the policy (LLM-42's offline figure)

    def protected_mask(self) -> list[bool]:
        n = len(self.prompt_ids)
        k = max(1, round(self.protected * n)) if self.protected > 0 else 0
        step = n / k if k else 0
        chosen = {int(i * step) for i in range(k)}  # spread over the batches
        return [i in chosen for i in range(n)]


class Bench:
    def __init__(self, llm: LLM, progress: bool = True, references: dict | None = None,
                 peers: dict | None = None):
        self.llm, self.progress = llm, progress
        self.peers = peers or {}  # in-process peers, interleaved with the policies
        # the reference does not depend on the batch size: share it across benches of one model
        self._reference: dict[tuple, list[int]] = {} if references is None else references

    def reference(self, ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in self._reference:
            run = CachedRuns(self.llm, [ids], max_new_tokens, progress=False).run(
                {"kind": "bench-reference"}, [[0]], lambda i, r: (self.llm.policy("reference"), None))
            self._reference[key] = run["rows"][0][1]
        return self._reference[key]

    def run_once(self, variant: str, w: Workload) -> dict:
        if variant in self.peers:
            return self.peers[variant].run_once(w.prompt_ids, w.max_new_tokens, w.batch_size)
        spec = VARIANTS[variant]
        n = len(w.prompt_ids)
        mask = [True] * n if variant in PROTECT_ALL else w.protected_mask()
        assert self.llm.engine.config.max_num_seqs == w.batch_size
        # one stream of every request, arriving at once: the engine batches them B at a time
        run = CachedRuns(self.llm, w.prompt_ids, w.max_new_tokens, progress=False).run(
            {"kind": "bench", "variant": variant}, [list(range(n))],
            lambda i, r: (self.llm.policy(spec if mask[i] else UNPROTECTED), None), arrivals=[[0] * n])
        protected = [row for row in run["rows"] if mask[row[0]]]
        refs = {i: self.reference(w.prompt_ids[i], w.max_new_tokens) for i, *_ in protected}
        judged = compare.judge(refs, protected)
        figures = compare.summary(judged, ("runs", "flips", "sequence_determinism", *GATE_FIGURES))
        return {"seconds": run["seconds"], "tokens": sum(len(row[1]) for row in run["rows"]),
                "sequence_determinism": figures["sequence_determinism"], "diverged": figures["flips"],
                "protected_requests": figures["runs"], **{k: figures[k] for k in GATE_FIGURES}}

    def compare(self, variants: list[str], w: Workload, repeats: int, warmup: int,
                external: dict[str, list[dict]] | None = None, decode_only: bool = False) -> dict:
        """Warm every variant up on one batch, then run each `repeats` times, interleaved.
        `external`: runs measured out of process (the vLLM peer), summarised alongside.
        `decode_only`: each repetition also runs the workload with one new token (prefill and the
        first token), so decode alone is the difference (`summarise`)."""
        variants = variants + list(self.peers)
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        first = Workload(w.prompt_ids, 1, w.batch_size, w.protected)
        for ids in tqdm(w.prompt_ids, desc="reference (alone)", disable=not self.progress, leave=False):
            self.reference(ids, w.max_new_tokens)
        # one batch of prompts is enough to warm kernels and allocators; the full workload is not needed
        head = Workload(w.prompt_ids[:w.batch_size], w.max_new_tokens, w.batch_size, w.protected)
        bar = tqdm(total=(warmup + repeats) * len(variants), desc=f"bench B={w.batch_size} protected={w.protected:.0%}",
                   disable=not self.progress, leave=False)
        for rep in range(warmup + repeats):
            for v in variants:
                out = self.run_once(v, head if rep < warmup else w)
                if rep >= warmup:
                    if decode_only:
                        out["first_token_seconds"] = self.run_once(v, first)["seconds"]
                    runs[v].append(out)
                bar.update()
        bar.close()
        return summarise({**runs, **(external or {})}, w)


def summarise(runs: dict[str, list[dict]], w: Workload) -> dict:
    out = {}
    for v, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        med = statistics.median(secs)
        last = rs[-1]
        out[v] = {"seconds_median": med, "seconds_min": min(secs), "seconds_max": max(secs),
                  "tokens_per_s": last["tokens"] / med,
                  "ms_per_token_per_request": 1000 * med / (w.max_new_tokens * -(-len(w.prompt_ids) // w.batch_size)),
                  **{k: last[k] for k in RUN_FIGURES}}
        if "first_token_seconds" in last:  # decode alone: the run less its prefill and first token
            first = statistics.median(r["first_token_seconds"] for r in rs)
            out[v].update(first_token_seconds_median=first,
                          decode_tokens_per_s=(last["tokens"] - len(w.prompt_ids)) / max(med - first, 1e-9))
    if BASELINE in out:
        base = out[BASELINE]["seconds_median"]
        for v in out:
            out[v]["overhead"] = compare.overhead(out[v]["seconds_median"], base)
        inc = lambda v: out[v]["seconds_median"] - base  # noqa: E731
        if MARGIN in out and inc(MARGIN) > 0:
            for v in INCREMENT_OVER_MARGIN:
                if v in out:
                    out[v]["increment_ratio_over_margin"] = inc(v) / inc(MARGIN)
    return out


def format_table(title: str, summary: dict) -> str:
    decode = any("decode_tokens_per_s" in r for r in summary.values())
    head = ("| policy | time s (median, min-max) | tok/s | " + ("decode-only tok/s | " if decode else "") +
            "ms/tok | of floor | overhead | seq. det. | trigger | repair | replayed | rollbacks | incr. / margin |")
    lines = [f"### {title}", "", head, "|" + "---|" * (12 + decode)]
    for v, r in summary.items():
        inc = r.get("increment_ratio_over_margin")
        dec = f"{r['decode_tokens_per_s']:.1f} | " if decode else ""
        lines.append(f"| {v} | {r['seconds_median']:.2f} ({r['seconds_min']:.2f}-{r['seconds_max']:.2f}) | "
                     f"{r['tokens_per_s']:.1f} | {dec}{r['ms_per_token_per_request']:.1f} | "
                     f"{percent(r.get('floor_fraction'))} | {percent(r.get('overhead'))} | "
                     f"{percent(r['sequence_determinism'])} | {percent(r['trigger_rate'])} | "
                     f"{percent(r['repair_rate'])} | {r['replayed_tokens']} | "
                     f"{r['rollbacks']} | {'-' if inc is None else f'{inc:.2f}x'} |")
    return "\n".join(lines)


def run_bench(llm_factory, prompts_ids: list[list[int]], variants: list[str], batch_sizes: list[int],
              max_new_tokens: int, repeats: int, warmup: int, protected_shares: list[float],
              out: Path | None, progress: bool = True, peers: dict | None = None, workload: str = "",
              profile_passes: bool = True, decode_only: bool = False, step_profile: bool = True) -> dict:
    report = {"workload": workload, "max_new_tokens": max_new_tokens, "prompts": len(prompts_ids),
              "repeats": repeats, "warmup": warmup, "variants": variants, "main": {}, "protected_sweep": {},
              "peers": {}}
    references: dict = {}
    peers = peers or {}
    floor = None
    in_process = {k: p for k, p in peers.items() if hasattr(p, "run_once")}
    for b in batch_sizes:
        external = {}
        for name, peer in peers.items():
            if name not in in_process:  # out of process: its own warm-up and repeats, before ours
                res = peer.run(prompts_ids, max_new_tokens, b, repeats, warmup)
                if decode_only:  # its prefill and first token, in the same worker setup
                    first = peer.run(prompts_ids, 1, b, repeats, warmup)["runs"]
                    for r in res["runs"]:
                        r["first_token_seconds"] = statistics.median(f["seconds"] for f in first)
                external[name] = res["runs"]
                report["peers"][name] = {k: v for k, v in res.items() if k != "runs"}  # version, weights, ...
        llm = llm_factory(b)
        report["environment"] = llm.environment()
        if floor is None:  # the machine's bandwidth and GEMM rate at the engine's thread count
            from ..models.weights import streamed_bytes  # torch: loaded by the model already

            cost = StepCost.of(llm.config, streamed_bytes(llm.model.own_weights))
            report["roofline"] = floor = roofline(cost, measure(llm.engine.num_threads),
                                                  [len(p) for p in prompts_ids], max_new_tokens, batch_sizes)
            if step_profile:  # B = 1 decode against the same bandwidth, and where its step's time goes
                report["decode_roofline"] = decode_roofline(llm, floor["machine"]["read_gb_s"])
        bench = Bench(llm, progress, references, in_process)
        summary = bench.compare(variants, Workload(prompts_ids, max_new_tokens, b), repeats, warmup, external,
                                decode_only)
        for row in summary.values():
            row["floor_fraction"] = row["tokens_per_s"] / floor["floor"][f"B{b}"]["tokens_per_s"]
        report["main"][f"B{b}"] = summary
        report.setdefault("rss_mb", {})[f"B{b}"] = {"margingate": rss_mb(),
                                                    **{k: p.get("rss_mb") for k, p in report["peers"].items()}}
        if profile_passes and b == max(batch_sizes) and len(prompts_ids) >= b:
            report["pass_profile"] = pass_profile(llm, prompts_ids, repeats=max(3, repeats))
        bench.peers = {}  # the protected-share sweep is about our policies only
        if protected_shares and b == min(batch_sizes):
            sweep_variants = [v for v in variants if v in SWEEP_VARIANTS]
            for share in protected_shares:
                w = Workload(prompts_ids, max_new_tokens, b, protected=share)
                report["protected_sweep"][str(share)] = bench.compare(sweep_variants, w, repeats, warmup)
    if out:
        written = write_report(report, out, markdown, lambda r, o: plots.bench_plots(r, o, BASELINE), indent=2)
        report["plots"] = [str(p) for p in written]
    return report


def markdown(report: dict) -> str:
    env = report.get("environment", {})
    parts = [f"# margingate bench\n\n{report['prompts']} prompts ({report.get('workload') or 'prompts'}) x "
             f"{report['max_new_tokens']} tokens (EOS ignored), median of {report['repeats']} after "
             f"{report['warmup']} warm-up on one batch; {env.get('model')} on {env.get('device')}: "
             f"{machine_line(env)}; tau {env.get('default_tau')} ({env.get('tau_source')}).\n"]
    if report.get("roofline"):
        parts.append(format_roofline(report["roofline"]))
    if report.get("decode_roofline"):
        parts.append(format_decode_roofline(report["decode_roofline"]))
    for key, summary in report["main"].items():
        parts.append(format_table(f"batch size {key[1:]}, all requests protected", summary))
        rss = report.get("rss_mb", {}).get(key, {})
        if rss:  # resident memory once the runs are done: the model, its KV cache, the runtime
            parts.append("Resident memory after the runs: " + ", ".join(
                f"{k} {v:,.0f} MB" for k, v in rss.items() if v is not None) + ".")
        peers = [v for v in summary if v in {c.name for c in PEERS.values()}]
        if peers and BASELINE in summary:
            ratios = ", ".join(f"{summary[BASELINE]['tokens_per_s'] / summary[v]['tokens_per_s']:.2f}x {v}"
                               for v in peers)
            parts.append(f"`fast` throughput over the peers at B={key[1:]}: {ratios}. Peers are judged against "
                         "themselves decoding each prompt alone; HF runs static groups of B (no continuous "
                         "batching).")
    if report.get("pass_profile"):
        parts.append(format_profile(report["pass_profile"]))
    for share, summary in report.get("protected_sweep", {}).items():
        parts.append(format_table(f"protected share {float(share):.0%} (the rest: fast)", summary))
    return "\n\n".join(parts) + "\n"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="every policy side by side on one workload, in one run")
    p.add_argument("--prompts-file", help="JSON lines (default: the built-in prompts)")
    p.add_argument("--dataset", help="humaneval, sharegpt, champ or builtin, instead of --prompts-file")
    p.add_argument("--seed", type=int, default=0, help="seed of the --dataset subset")
    p.add_argument("--limit", type=int, default=32, help="number of prompts")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=128)
    p.add_argument("--batch-sizes", type=cli_args.int_list, default=[8, 16])
    p.add_argument("--policies", default=",".join(DEFAULT_VARIANTS), help=f"any of {','.join(VARIANTS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--protected", default="", help="protected-share sweep at the smallest batch size, e.g. 0.125,0.5")
    p.add_argument("--peers", default="", help="also run hf (transformers generate), vllm (needs "
                   "`make vllm-venv`) and/or llamacpp (needs `make llamacpp-venv`) on the same prompts, "
                   "e.g. hf,vllm,llamacpp")
    p.add_argument("--no-pass-profile", action="store_true",
                   help="skip timing one fast step against verifier passes at the largest batch size")
    p.add_argument("--no-step-profile", action="store_true",
                   help="skip B = 1 decode against the read floor and its per-step profile (analysis/step_profile.py)")
    p.add_argument("--decode-only", action="store_true",
                   help="also time each contender with one new token, and report decode alone (the difference)")
    p.add_argument("--quick", action="store_true",
                   help="8 prompts, 32 tokens, batch 8, 1 repeat, no warm-up, no pass profile")
    p.add_argument("--out", default="results/bench", help="folder for report.json, report.md and plots")
    p.add_argument("--json", action="store_true")
    cli_args.add_model_args(p)
    p.set_defaults(func=_cmd)


def _cmd(args) -> None:
    variants = [v.strip() for v in args.policies.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown bench policy {bad[0]!r} (choose from {', '.join(VARIANTS)})")
    if args.quick:
        args.limit, args.max_new_tokens, args.batch_sizes, args.repeats, args.warmup = 8, 32, [8], 1, 0
        args.no_pass_profile = args.no_step_profile = True
    peer_names = [x.strip() for x in args.peers.split(",") if x.strip()]
    if any(n not in PEERS for n in peer_names):
        raise ValueError(f"unknown peer {next(n for n in peer_names if n not in PEERS)!r} "
                         f"(choose from {', '.join(PEERS)})")
    shares = [float(x) for x in args.protected.split(",") if x.strip()]
    if any(not 0 < s <= 1 for s in shares):
        raise ValueError("--protected shares must be in (0, 1]")
    cache = {}

    def factory(b):
        if b not in cache:
            cache.clear()
            cache[b] = cli_args.llm(args, b)
        return cache[b]

    llm = factory(max(args.batch_sizes))
    if args.dataset:
        from ..data.datasets import dataset_prompts
        prompts = dataset_prompts(args.dataset, args.limit, args.seed, llm.tokenizer)
    else:
        prompts = cli_args.prompts(args)
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    from ..models.loader import gguf_parts  # loads torch: only when the command runs

    parts = gguf_parts(args.model) if kept_quantized(llm.environment()) else None
    gguf = parts[0] if parts and len(parts) == 1 else None
    # only llama.cpp on the GGUF itself reads no bf16 tensors
    folder = llm.folder if gguf and set(peer_names) <= {"llamacpp"} else llm.weights_folder()
    peers = make_peers(peer_names, folder, llm.engine.num_threads, gguf)
    report = run_bench(factory, ids, variants, args.batch_sizes, args.max_new_tokens, args.repeats, args.warmup,
                       shares, Path(args.out) if args.out else None, progress=not args.json, peers=peers,
                       workload=args.dataset or args.prompts_file or "built-in prompts",
                       profile_passes=not args.no_pass_profile, decode_only=args.decode_only,
                       step_profile=not args.no_step_profile)
    print(json.dumps(report) if args.json else markdown(report))
    if args.device.startswith("cuda"):  # what `auto` resolves to on this GPU from now on
        from ..options.auto_rule import record

        path = record(report, args.device)
        print(f"auto on this GPU: recorded in {path}" if path else
              "auto on this GPU: not decided (bench fast, batch-invariant and margin together)", file=sys.stderr)
