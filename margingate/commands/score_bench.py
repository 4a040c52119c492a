"""`margingate bench-score`: echo scoring (the prompt's own logprobs, what lm-eval's loglikelihood
tasks ask) in prompt tokens per second, ours against vLLM's `prompt_logprobs`, same prompts, same
threads, one run. Each side also scores its first prompts alone: the share whose logprobs are
bitwise those of the batched run is its scoring's batch invariance."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from .. import cli_args
from ..analysis.outputs import machine_line, write_report
from ..data.datasets import dataset_prompts
from ..peers import VLLMPeer, run_worker

ALONE = 8  # prompts scored alone by each side, for the invariance check


def score_ours(llm, ids: list[list[int]], repeats: int, warmup: int, batch: int) -> dict:
    pairs = [(p[:1], p[1:]) for p in ids]
    for _ in range(warmup):
        llm.score_batch(pairs[:batch])
    seconds, scores = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        scores = llm.score_batch(pairs)
        seconds.append(time.perf_counter() - t)
    logprobs = [[None, *s.logprobs] for s in scores]
    alone = [[None, *llm.score(*pair).logprobs] for pair in pairs[:ALONE]]
    return {"seconds": seconds, "logprobs": logprobs, "alone": alone}


def summarise(name: str, data: dict, tokens: int) -> dict:
    med = statistics.median(data["seconds"])
    same = [a == b for a, b in zip(data["alone"], data["logprobs"])]
    return {"name": name, "seconds": data["seconds"], "median_s": med, "prompt_tokens_per_s": tokens / med,
            "alone_equals_batched": f"{sum(same)}/{len(same)}", **({"version": data["version"]}
                                                                  if "version" in data else {})}


def max_gap(a: list[list], b: list[list]) -> float:
    """The largest |ours - theirs| over every scored token: both score the same weights."""
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p[1:], q[1:]))


def markdown(report: dict) -> str:
    lines = [f"# Echo scoring: {report['prompts']} prompts, {report['prompt_tokens']} prompt tokens, "
             f"B = {report['batch_size']}", "", f"Machine: {report['machine']}", "",
             "| engine | prompt tok/s | median s | alone = batched (bitwise) |", "|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['name']} | {row['prompt_tokens_per_s']:.0f} | {row['median_s']:.2f} | "
                     f"{row['alone_equals_batched']} |")
    if "max_logprob_gap" in report:
        lines += ["", f"Largest |margingate - vLLM| logprob over all tokens: {report['max_logprob_gap']:.4f}"]
    return "\n".join(lines) + "\n"


def _cmd(args) -> None:
    llm = cli_args.llm(args, args.batch_size)
    prompts = dataset_prompts(args.dataset, args.limit, args.seed, llm.tokenizer, args.max_prompt_tokens)
    ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
    tokens = sum(map(len, ids))
    ours = score_ours(llm, ids, args.repeats, args.warmup, args.batch_size)
    rows = [summarise("margingate (invariant prefill)", ours, tokens)]
    report = {"prompts": len(ids), "prompt_tokens": tokens, "batch_size": args.batch_size,
              "machine": machine_line(llm.environment()), "environment": llm.environment(), "rows": rows}
    if args.vllm:
        peer = VLLMPeer(llm.weights_folder(), llm.engine.num_threads)
        theirs = run_worker(peer.python, "vllm_score_worker.py", {
            "model": str(peer.folder), "prompt_ids": ids, "batch_size": args.batch_size, "repeats": args.repeats,
            "warmup": args.warmup, "alone": ALONE}, peer.env(), "vllm")
        rows.append(summarise("vLLM CPU (prompt_logprobs)", theirs, tokens))
        report["max_logprob_gap"] = max_gap(ours["logprobs"], theirs["logprobs"])
        report["ratio_ours_over_vllm"] = rows[0]["prompt_tokens_per_s"] / rows[1]["prompt_tokens_per_s"]
    write_report(report, Path(args.out), markdown)
    print(markdown(report))


def add_parser(sub) -> None:
    p = sub.add_parser("bench-score", help="echo scoring throughput (prompt tokens/s), ours and vLLM's, one run")
    p.add_argument("--dataset", default="sharegpt", help="humaneval, sharegpt, champ or builtin")
    p.add_argument("--limit", type=cli_args.positive_int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=cli_args.positive_int, default=512)
    p.add_argument("--batch-size", type=cli_args.positive_int, default=16)
    p.add_argument("--repeats", type=cli_args.positive_int, default=3)
    p.add_argument("--warmup", type=cli_args.non_negative_int, default=1)
    p.add_argument("--vllm", action="store_true", help="also vLLM's CPU build (make vllm-venv)")
    p.add_argument("--out", default="results/bench-score")
    cli_args.add_model_args(p)
    p.set_defaults(func=_cmd)
