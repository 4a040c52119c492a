"""`make demo`: the problem (flips under batching) and the fix (MarginGate) in one screen."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import cli_args
from ..analysis.compare import counter_totals, first_divergence
from ..data.prompts import builtin_prompts

if TYPE_CHECKING:  # the facade loads the model stack: only when the command runs
    from ..llm import LLM

PICK = (0, 10, 20, 30, 5, 15, 25, 35)  # two of each category: math, code, chat, instruction


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="the problem and the fix on 8 built-in prompts")
    d.add_argument("--max-new-tokens", type=cli_args.positive_int, default=96)
    cli_args.add_model_args(d)
    d.set_defaults(func=cmd_demo)


def cmd_demo(args) -> None:
    run_demo(cli_args.llm(args, 8), max_new_tokens=args.max_new_tokens)


def _show(llm: LLM, ids: list[int], at: int) -> str:
    before = llm.tokenizer.decode(ids[max(0, at - 8):at]).replace("\n", "\\n")
    tok = llm.tokenizer.token_str(ids[at]).replace("\n", "\\n") if at < len(ids) else "<end>"
    return f"...{before[-40:]}[{tok}]"


def run_demo(llm: LLM, max_new_tokens: int = 96) -> None:
    prompts = [builtin_prompts()[i] for i in PICK]
    env = llm.environment()
    print(f"model {env['model']} on {env['device']}, torch {env['torch']}, {env['num_threads']} threads; "
          f"{len(prompts)} prompts, {max_new_tokens} new tokens, greedy\n")

    def timed(policy):
        t = time.perf_counter()
        out = llm.generate(prompts, max_new_tokens=max_new_tokens, policy=policy)
        return out, time.perf_counter() - t

    def alone(policy: str):
        return [llm.generate([p], max_new_tokens=max_new_tokens, policy=llm.policy(policy))[0] for p in prompts]

    fast_alone, reference = alone("fast"), alone("reference")
    fast, t_fast = timed(llm.policy("fast"))
    margin, t_margin = timed(llm.policy("margin"))
    invariant, t_invariant = timed(llm.policy("batch-invariant"))

    print("1) Each prompt decoded alone, then inside one heterogeneous batch of 8 (policy fast):")
    flips = 0
    for i, (p, a, f) in enumerate(zip(prompts, fast_alone, fast)):
        d = first_divergence(a.token_ids, f.token_ids)
        if d is None:
            print(f"  [{i}] {p.display():<62} identical")
            continue
        flips += 1
        print(f"  [{i}] {p.display():<62} FLIPS at token {d}")
        print(f"        alone  : {_show(llm, a.token_ids, d)}")
        print(f"        batched: {_show(llm, f.token_ids, d)}")
    print(f"  -> {flips}/{len(prompts)} outputs changed only because of what shared the batch.\n")

    same = lambda outs: sum(o.token_ids == r.token_ids for o, r in zip(outs, reference))  # noqa: E731
    cost = lambda t: f"time {t:.1f}s vs fast {t_fast:.1f}s ({100 * (t / t_fast - 1):+.0f}%, all 8 protected)"  # noqa: E731
    totals = counter_totals(m.stats for m in margin)
    steps, trig, fixed = totals["steps"], totals["triggers"], totals["repairs"]
    print("2) The same batch with policy margin (verify only near-tie steps, replay repair):")
    print(f"  -> {same(margin)}/{len(prompts)} identical to the request decoded alone by the verifier; gate fired "
          f"at {trig}/{steps} steps ({100 * trig / max(steps, 1):.1f}%), {fixed} flips repaired before release; "
          f"{cost(t_margin)}.")
    print("3) The same batch with policy batch-invariant (every reduction's order fixed by the row alone):")
    print(f"  -> {same(invariant)}/{len(prompts)} identical to decoding alone; {cost(t_invariant)}.")
    print(f"\nThe same tokens at any thread count ({env['num_threads']} here; try --threads 1).")
    print("Next: margingate check --policy margin | --policy fast   (the full protocol)")
