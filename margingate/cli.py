"""Command line: argument parsing only; the work happens in the layers below."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from .data.prompts import Prompt, PromptFileError, builtin_prompts, load_prompts_file
from .kernels.invariant import KernelBuildError
from .models.loader import DEFAULT_MODEL
from .policies import DEFAULT_DEFER, DEFAULT_GROUP, DEFAULT_WINDOW, POLICIES, REPAIRS


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _tau(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"tau must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"tau must be a finite number >= 0, got {text!r}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"embedded model name or a local Hugging Face folder (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: all cores; the tokens do not depend on it)")
    p.add_argument("--max-model-len", type=int, default=2048, help="positions per request (prompt + output)")
    p.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                   help="prompt positions per request per step, sharing steps with decode rows (default: whole)")


def _add_policy_args(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--policy", default=default, choices=list(POLICIES))
    p.add_argument("--tau", type=_tau, default=None, help="margin threshold in logits (default: the model profile's)")
    p.add_argument("--repair", default="replay", choices=REPAIRS)
    p.add_argument("--verifier-precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--no-strict", action="store_true", help="margin/replay: never roll back emitted tokens")
    p.add_argument("--defer", type=int, default=DEFAULT_DEFER,
                   help="margin/replay: steps a flagged token may wait for a shared verifier pass (0: at once)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="dvr: tokens per verified window")
    p.add_argument("--group", type=int, default=DEFAULT_GROUP, help="dvr: requests per fixed-shape verifier pass")
    p.add_argument("--inject-flip-at", type=int, default=None, metavar="K",
                   help="testing: emit a wrong token at output index K to exercise rollback")


def _prompts(args) -> list[Prompt]:
    prompts = [Prompt("chat", ({"role": "user", "content": t},), None, f"argv:{i}")
               for i, t in enumerate(getattr(args, "prompt", None) or [])]
    if args.prompts_file:
        prompts += load_prompts_file(args.prompts_file)
    limit = getattr(args, "limit", None)
    if not prompts:
        prompts = builtin_prompts()
        if limit and limit < len(prompts):  # spread over the categories, not the first N (all math)
            return [prompts[i * len(prompts) // limit] for i in range(limit)]
    return prompts[:limit] if limit else prompts


def _llm(args, max_batch_size: int):
    from .llm import LLM

    return LLM(args.model, device=args.device, max_batch_size=max_batch_size,
               max_model_len=args.max_model_len, num_threads=args.threads, prefill_chunk=args.prefill_chunk)


def _policy_factory(llm, args, name: str | None = None):
    opts = dict(tau=args.tau, repair=args.repair, precision=args.verifier_precision, strict=not args.no_strict,
                window=args.window, group=args.group, defer=args.defer)

    def make():
        policy = llm.policy(name or args.policy, **opts)
        if args.inject_flip_at is not None:
            if not hasattr(policy, "inject_flip_at"):
                raise ValueError(f"--inject-flip-at needs a verifying policy, not {policy.name}")
            policy.inject_flip_at = args.inject_flip_at
        return policy

    make()  # validate once, up front
    return make


# --- commands ----------------------------------------------------------------------

def cmd_generate(args) -> None:
    prompts = _prompts(args)
    llm = _llm(args, args.max_batch_size)
    policy = _policy_factory(llm, args)
    reqs = llm.requests(prompts, max_new_tokens=args.max_new_tokens)
    for r in reqs:
        r.policy = policy()
    results = llm.engine.generate(reqs, progress=not args.json)
    for i, res in enumerate(results):
        c = llm.completion(i, res)
        if args.json:
            print(json.dumps({"prompt_index": i, "token_ids": c.token_ids, "text": c.text,
                              "finish_reason": c.finish_reason, "stats": c.stats}))
        else:
            print(f"--- [{i}] {prompts[i].display()}  ({c.finish_reason}, {len(c.token_ids)} tokens)")
            print(c.text)


def cmd_check(args) -> None:
    from .analysis.check import Checker, format_table, parse_modes

    modes = parse_modes(args.modes)
    prompts = _prompts(args)
    llm = _llm(args, max(args.batch_sizes))
    make = _policy_factory(llm, args)
    # The trajectory each policy promises. fast and layercast promise none: they are judged
    # against themselves alone (their kernels differ from the reference's, so comparing them
    # with it would count kernels or precision, not batching, as flips).
    ref_name = args.policy if args.policy in ("fast", "layercast") else "reference"
    reference = lambda: llm.policy(ref_name, precision=args.verifier_precision)  # noqa: E731
    t0 = time.perf_counter()
    report = Checker(llm, prompts, make, reference, args.max_new_tokens, progress=not args.json).run(
        args.batch_sizes, modes)
    report = {"policy": args.policy, "settings": make().settings(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes, "modes": modes,
              "environment": llm.environment(), "seconds": round(time.perf_counter() - t0, 1), **report}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report) if args.json else format_table(report))


def cmd_demo(args) -> None:
    from .analysis.demo import run_demo

    run_demo(_llm(args, 8), max_new_tokens=args.max_new_tokens)


class Common:
    """Helpers the registered subcommands share with the ones above."""
    add_model_args = staticmethod(_add_model_args)
    add_policy_args = staticmethod(_add_policy_args)
    prompts = staticmethod(_prompts)
    llm = staticmethod(_llm)
    policy_factory = staticmethod(_policy_factory)
    int_list = staticmethod(_int_list)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="margingate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode prompts (continuous batching)")
    g.add_argument("prompt", nargs="*", help="user messages (chat template applied)")
    g.add_argument("--prompts-file", help="JSON lines: {prompt|messages|text: ...}")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--max-batch-size", type=int, default=16)
    g.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    g.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_model_args(g)
    _add_policy_args(g, "fast")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("check", help="does a policy give the reference tokens whatever shares its batch?")
    c.add_argument("--prompts-file", help="JSON lines (default: the built-in prompts)")
    c.add_argument("--batch-sizes", type=_int_list, default=[4, 16])
    c.add_argument("--modes", default="hetero,homo,staggered", help="any of hetero,homo,staggered")
    c.add_argument("--max-new-tokens", type=int, default=128)
    c.add_argument("--limit", type=int, default=16, help="use only the first N prompts (0: all)")
    c.add_argument("--json", action="store_true")
    c.add_argument("--out", help="also write the JSON report here")
    _add_model_args(c)
    _add_policy_args(c, "margin")
    c.set_defaults(func=cmd_check)

    d = sub.add_parser("demo", help="the problem and the fix on 8 built-in prompts")
    d.add_argument("--max-new-tokens", type=int, default=96)
    _add_model_args(d)
    d.set_defaults(func=cmd_demo)

    # Subcommands defined beside their code: each module has add_parser(sub, common).
    # --- registered subcommands (one line each) ---
    from .server.cli import add_parser as _serve; _serve(sub, Common)  # noqa: E702, I001
    from .analysis.bench import add_parser as _bench; _bench(sub, Common)  # noqa: E702, I001
    from .analysis.flips import add_parser as _flips; _flips(sub, Common)  # noqa: E702, I001
    from .analysis.calibrate import add_parser as _calibrate; _calibrate(sub, Common)  # noqa: E702, I001
    # --- end registered subcommands ---
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        print("error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        args.func(args)
    except (PromptFileError, ValueError, FileNotFoundError, KernelBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
