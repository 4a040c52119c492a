"""Command line: argument parsing only; the work happens in the layers below."""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import args as cli
from . import scoring
from .analysis import bench, calibrate, flips, score_bench
from .data.prompts import PromptFileError
from .distributed.options import add_ray_args, worker_pool
from .kernels.invariant import KernelBuildError
from .policies import PolicySpec
from .server import cli as serve

#: subcommands defined beside their code: each module has add_parser(sub)
REGISTERED = (serve, bench, flips, calibrate, scoring, score_bench)


# --- commands ----------------------------------------------------------------------

def cmd_generate(args) -> None:
    spec = cli.policy_spec(args)  # refuses bad options before the model loads
    sampling = cli.sampling_params(args)
    prompts = cli.prompts(args)
    with worker_pool(args, args.max_batch_size) as pool:  # --ray: its workers decode, this process tokenizes
        llm = cli.llm(args, args.max_batch_size)
        reqs = llm.requests(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling)
        for r in reqs:
            r.policy = llm.policy(spec)
        if spec.chosen_by and not args.json:  # JSON lines carry it in each request's stats
            print(f"policy: {spec.name} (chosen by {spec.chosen_by} for {args.device})", file=sys.stderr)
        results = (pool or llm.engine).generate(reqs, progress=not args.json)
    for i, res in enumerate(results):
        c = llm.completion(i, res)
        if args.json:
            logprobs = {} if c.logprobs is None else {"logprobs": [
                {"token": t.token, "logprob": t.logprob, "top": [list(x) for x in t.top]} for t in c.logprobs]}
            print(json.dumps({"prompt_index": i, "token_ids": c.token_ids, "text": c.text,
                              "finish_reason": c.finish_reason, "stats": c.stats,
                              "seed": reqs[i].sampling.seed, **logprobs}))
        else:
            print(f"--- [{i}] {prompts[i].display()}  ({c.finish_reason}, {len(c.token_ids)} tokens)")
            print(c.text)


def cmd_check(args) -> None:
    from .analysis.check import Checker, format_table, parse_modes

    modes = parse_modes(args.modes)
    spec = cli.policy_spec(args)
    prompts = cli.prompts(args)
    with worker_pool(args, max(args.batch_sizes)) as pool:  # --ray: each batch runs whole on one worker
        llm = cli.llm(args, max(args.batch_sizes))
        # The trajectory each policy promises. A policy that promises none (fast, layercast) is judged
        # against itself alone (its kernels differ from the reference's, so comparing it with the
        # reference would count kernels or precision, not batching, as flips).
        ref = PolicySpec("reference", precision=spec.precision) if spec.policy_class.deterministic else spec
        make, reference = (lambda: llm.policy(spec)), (lambda: llm.policy(ref))
        t0 = time.perf_counter()
        report = Checker(llm, prompts, make, reference, args.max_new_tokens, progress=not args.json,
                         pool=pool).run(args.batch_sizes, modes)
        environment = (pool or llm).environment()  # with --ray: a worker's, and the pool's shape
    report = {"policy": spec.name, "chosen_by": spec.chosen_by, "settings": make().settings(),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes,
              "modes": modes,
              "environment": environment, "seconds": round(time.perf_counter() - t0, 1), **report}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report) if args.json else format_table(report))


def cmd_demo(args) -> None:
    from .analysis.demo import run_demo

    run_demo(cli.llm(args, 8), max_new_tokens=args.max_new_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="margingate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode prompts (continuous batching)")
    g.add_argument("prompt", nargs="*", help="user messages (chat template applied)")
    cli.add_prompt_args(g, None)
    g.add_argument("--max-new-tokens", type=cli.positive_int, default=128)
    g.add_argument("--max-batch-size", type=cli.positive_int, default=16)
    g.add_argument("--json", action="store_true", help="one JSON object per line")
    cli.add_sampling_args(g)
    cli.add_model_args(g)
    cli.add_prefix_cache_arg(g)
    cli.add_policy_args(g, "fast")
    add_ray_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("check", help="does a policy give the reference tokens whatever shares its batch?")
    cli.add_prompt_args(c, 16)
    c.add_argument("--batch-sizes", type=cli.int_list, default=[4, 16])
    c.add_argument("--modes", default="hetero,homo,staggered", help="any of hetero,homo,staggered")
    c.add_argument("--max-new-tokens", type=cli.positive_int, default=128)
    c.add_argument("--json", action="store_true")
    c.add_argument("--out", help="also write the JSON report here")
    cli.add_model_args(c)
    cli.add_policy_args(c, "margin")
    add_ray_args(c)
    c.set_defaults(func=cmd_check)

    d = sub.add_parser("demo", help="the problem and the fix on 8 built-in prompts")
    d.add_argument("--max-new-tokens", type=cli.positive_int, default=96)
    cli.add_model_args(d)
    d.set_defaults(func=cmd_demo)

    for module in REGISTERED:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (PromptFileError, ValueError, FileNotFoundError, KernelBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
