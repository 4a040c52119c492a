"""Rollouts from the engine and their logprobs recomputed by a trainer, side by side.

What an RL loop does each step, in the shapes it does it: sample rollouts (prompt + sampled tokens, and
the logprob the engine reported for each sampled token), pad them into a trainer batch, recompute the
same tokens' logprobs with the trainer's forward, and compare. Under a deterministic policy with
`TrainableModel` as the trainer the two are bitwise equal; `fast` rollouts, or another forward as the
trainer, are the inverse controls.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..engine import Request
from ..engine.engine import Engine
from ..engine.logprobs import token_logprobs
from ..options import SamplingParams


@dataclass
class Rollout:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]     # the engine's report of each sampled token, in the request's logprobs mode
    sampling: SamplingParams

    @property
    def ids(self) -> list[int]:
        return [*self.prompt_ids, *self.token_ids]


def sample(engine: Engine, prompts: list[list[int]], sampling: SamplingParams, policy, *,
           max_new_tokens: int = 32, traffic: list[Request] = ()) -> list[Rollout]:
    """One rollout per prompt (sample i of a seeded request takes seed + i), run beside `traffic` (other
    requests sharing the batches, as a serving engine's rollouts are); logprobs reported for each token."""
    sampling = replace(sampling, logprobs=0) if sampling.logprobs is None else sampling
    requests = [Request(list(p), max_new_tokens, policy, request_id=f"rollout-{i}", sampling=sampling.for_sample(i))
                for i, p in enumerate(prompts)]
    results = engine.generate([*requests, *traffic])[:len(requests)]
    return [Rollout(r.prompt_ids, res.token_ids, [t.logprob for t in res.logprobs], r.sampling)
            for r, res in zip(requests, results)]


def padded(sequences: list[list[int]], side: str = "right", pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [len(sequences), longest] with the padding on `side`."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(sequences):
        at = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[b, at], mask[b, at] = torch.tensor(s), 1
    return ids, mask


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, attention_mask) -> fp32 logits


def rescored(forward: Forward, rollouts: list[Rollout], side: str = "right") -> list[torch.Tensor]:
    """Each rollout's sampled tokens' logprobs as the trainer's forward gives them, in the rollout's own
    logprobs mode (processed: at its temperature and filters), from one padded batch."""
    ids, mask = padded([r.ids for r in rollouts], side)
    logits = forward(ids, mask)
    width, cols = ids.shape[1], []
    for b, r in enumerate(rollouts):  # the columns of each rollout's sampled tokens
        first = b * width + int(mask[b].nonzero()[0]) + len(r.prompt_ids)
        cols.append(torch.arange(first, first + len(r.token_ids)))
    picked = torch.cat(cols)
    # one gather for all rollouts: a slice per rollout would cost a logits-sized gradient each
    rows = logits.reshape(-1, logits.shape[-1]).index_select(0, picked - 1).split([len(c) for c in cols])
    tokens = ids.flatten()[picked].split([len(c) for c in cols])
    out = []
    for r, row, token in zip(rollouts, rows, tokens):
        sp = r.sampling
        mode = "processed" if sp.processed_logprobs else "raw"
        out.append(token_logprobs(row, token, mode, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                                  min_p=sp.min_p))
    return out


@dataclass
class Mismatch:
    tokens: int          # sampled tokens compared
    differing: int       # of them, those whose trainer logprob is not the rollout's bitwise
    max_abs: float       # max |trainer logprob - rollout logprob|

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "differing": self.differing, "max_abs": self.max_abs}


def compare(rollouts: list[Rollout], trainer: list[torch.Tensor]) -> Mismatch:
    diffs = [(t.detach().double() - torch.tensor(r.logprobs, dtype=torch.float64)).abs()
             for r, t in zip(rollouts, trainer)]
    flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    return Mismatch(flat.numel(), int((flat != 0).sum()), float(flat.max()) if flat.numel() else 0.0)
