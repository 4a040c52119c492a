"""Scoring: the logprobs of a given continuation after a prompt (lm-eval's loglikelihood, an RL
trainer's logprobs of a rollout). One engine request per pair: prompt + continuation as the
prompt, no new token, prompt logprobs on. Prompts always run the invariant kernels, and a
position's logits are the same in a prompt row and a decode row, so the scores are, bitwise,
what a guaranteed policy reported while generating the same tokens."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .engine import Engine, Request
from .engine.logprobs import TokenLogprob
from .engine.sampling import MAX_LOGPROBS, SamplingParams


@dataclass
class Score:
    token_ids: list[int]               # the continuation
    tokens: list[TokenLogprob]         # one per continuation token, with at least its top-1
    top_logprobs: int = 0              # alternatives asked for (`tokens` may hold one more)

    @property
    def logprobs(self) -> list[float]:
        return [t.logprob for t in self.tokens]

    @property
    def total(self) -> float:
        return sum(self.logprobs)

    @property
    def is_greedy(self) -> bool:
        """Is every continuation token the most likely one (a tie counts, as lm-eval counts it)?"""
        return all(t.logprob == t.top[0][1] for t in self.tokens)

    def as_dict(self) -> dict:
        out = {"continuation_ids": self.token_ids, "logprobs": self.logprobs, "sum": self.total,
               "is_greedy": self.is_greedy}
        if self.top_logprobs:
            out["top_logprobs"] = [[list(pair) for pair in t.top[:self.top_logprobs]] for t in self.tokens]
        return out


def score_pairs(engine: Engine, pairs: list[tuple[list[int], list[int]]], top_logprobs: int = 0,
                progress: bool = False) -> list[Score]:
    for i, (prompt, continuation) in enumerate(pairs):
        if not prompt or not continuation:
            raise ValueError(f"pair {i}: scoring needs a non-empty prompt and a non-empty continuation")
    sampling = SamplingParams(prompt_logprobs=max(1, top_logprobs))  # is_greedy needs the top token
    reqs = [Request(list(p) + list(c), 0, sampling=sampling, request_id=f"score-{i}", ignore_eos=True)
            for i, (p, c) in enumerate(pairs)]
    results = engine.generate(reqs, progress=progress)
    return [Score(list(c), res.prompt_logprobs[len(p):], top_logprobs) for (p, c), res in zip(pairs, results)]


# --- `margingate score` -------------------------------------------------------------------------

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
    from . import cli_args

    llm = cli_args.llm(args, args.max_batch_size)
    pairs = read_pairs(args, llm.tokenizer)
    scores = llm.score_batch(pairs, top_logprobs=args.top_logprobs, progress=len(pairs) > 1)
    for i, score in enumerate(scores):
        print(json.dumps({"index": i, **score.as_dict()}))


def add_parser(sub) -> None:
    from . import cli_args

    p = sub.add_parser("score", help="logprobs of a continuation after a prompt (what generation reports)")
    p.add_argument("--prompt", help="the prompt text (encoded without special tokens)")
    p.add_argument("--continuation", help="the text whose tokens are scored")
    p.add_argument("--file", help="JSON lines: {prompt, continuation} or {prompt_ids, continuation_ids}")
    p.add_argument("--top-logprobs", type=cli_args.int_at_least(0), default=0, metavar="K",
                   help=f"also the K most likely tokens at each position (at most {MAX_LOGPROBS})")
    p.add_argument("--max-batch-size", type=cli_args.positive_int, default=16)
    cli_args.add_model_args(p)
    p.set_defaults(func=cmd_score)
