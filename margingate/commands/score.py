"""`margingate score`: the logprobs of given continuations after given prompts, through `scoring.py`."""
from __future__ import annotations

import json

from .. import cli_args
from ..options import MAX_LOGPROBS


def read_pairs(args, tokenizer) -> list[tuple[list[int], list[int]]]:
    """--prompt/--continuation, or a JSON-lines file of {prompt, continuation} (text) or
    {prompt_ids, continuation_ids}; text is encoded part by part, as lm-eval does."""
    items = []
    if args.prompt is not None or args.continuation is not None:
        if args.prompt is None or args.continuation is None:
            raise ValueError("--prompt and --continuation go together")
        items.append({"prompt": args.prompt, "continuation": args.continuation})
    if args.file:
        with open(args.file) as f:
            items += [json.loads(line) for line in f if line.strip()]
    if not items:
        raise ValueError("nothing to score: give --prompt and --continuation, or --file")
    pairs = []
    for i, item in enumerate(items):
        if "prompt_ids" in item:
            pairs.append((item["prompt_ids"], item["continuation_ids"]))
        elif "prompt" in item and "continuation" in item:
            pairs.append((tokenizer.encode(item["prompt"]), tokenizer.encode(item["continuation"])))
        else:
            raise ValueError(f"item {i}: expected prompt + continuation or prompt_ids + continuation_ids")
    return pairs


def cmd_score(args) -> None:
    llm = cli_args.llm(args, args.max_num_seqs)
    pairs = read_pairs(args, llm.tokenizer)
    scores = llm.score_batch(pairs, top_logprobs=args.top_logprobs, progress=len(pairs) > 1)
    for i, score in enumerate(scores):
        print(json.dumps({"index": i, **score.as_dict()}))


def add_parser(sub) -> None:
    p = sub.add_parser("score", help="logprobs of a continuation after a prompt (what generation reports)")
    p.add_argument("--prompt", help="the prompt text (encoded without special tokens)")
    p.add_argument("--continuation", help="the text whose tokens are scored")
    p.add_argument("--file", help="JSON lines: {prompt, continuation} or {prompt_ids, continuation_ids}")
    p.add_argument("--top-logprobs", type=cli_args.int_at_least(0), default=0, metavar="K",
                   help=f"also the K most likely tokens at each position (at most {MAX_LOGPROBS})")
    cli_args.add_engine_args(p, ["max_num_seqs"])
    cli_args.add_model_args(p)
    p.set_defaults(func=cmd_score)
