"""`margingate generate`: decode prompts with continuous batching; text, or one JSON object per line."""
from __future__ import annotations

import json
import sys

from .. import cli_args
from ..distributed.options import add_ray_args, worker_pool


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="decode prompts (continuous batching)")
    g.add_argument("prompt", nargs="*", help="user messages (chat template applied)")
    cli_args.add_prompt_args(g, None)
    g.add_argument("--max-new-tokens", type=cli_args.positive_int, default=128)
    cli_args.add_engine_args(g, ["max_num_seqs"])
    g.add_argument("--json", action="store_true", help="one JSON object per line")
    cli_args.add_sampling_args(g)
    cli_args.add_speculative_args(g)
    cli_args.add_model_args(g)
    cli_args.add_prefix_cache_arg(g)
    cli_args.add_policy_args(g, "fast")
    add_ray_args(g)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args) -> None:
    spec = cli_args.policy_spec(args)  # refuses bad options before the model loads
    sampling = cli_args.sampling_params(args)
    speculative = cli_args.speculative_config(args)
    prompts = cli_args.prompts(args)
    with worker_pool(args, args.max_num_seqs) as pool:  # --ray: its workers decode, this process tokenizes
        llm = cli_args.llm(args, args.max_num_seqs)
        if sampling.structured is not None:
            cli_args.compile_or_exit(llm, sampling.structured)
        reqs = llm.requests(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                            speculative=speculative)
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
