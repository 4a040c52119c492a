"""Scoring: the logprobs of a given continuation after a prompt (lm-eval's loglikelihood, an RL
trainer's logprobs of a rollout). One engine request per pair: prompt + continuation as the
prompt, no new token, prompt logprobs on. Prompts always run the invariant kernels, and a
position's logits are the same in a prompt row and a decode row, so the scores are, bitwise,
what a guaranteed policy reported while generating the same tokens."""
from __future__ import annotations

from dataclasses import dataclass

from .engine import Request
from .engine.engine import Engine
from .engine.logprobs import TokenLogprob
from .options import SamplingParams


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
