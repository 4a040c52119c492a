"""Speculative decoding that cannot change a token: proposals checked by the invariant kernels.

A proposer guesses the next k tokens of a request. The engine feeds [last token, d1..dk] as one
span of the step's forward, through the invariant kernels with exact attention: each row's
logits are bitwise the logits of decoding that position alone (the kernels are row-independent),
so row i chooses, with the request's own sampling (seeded Gumbel noise keyed by position), the
token that plain decoding would choose after d1..di. The engine accepts drafts while they equal
those choices and emits the first choice that differs: the output is the plain output, fewer
passes over the weights.

It applies to requests whose plain decode rows are already canonical (`batch-invariant`, bf16
`reference`) and to `fast` (which promises nothing either way). A verifying policy decodes on the
fast path and repairs later; its requests decode without speculation, and the report says so.
"""
from __future__ import annotations

import time

import torch

from .sampling import scores
from .sequence import Sequence


def off_reason(policy) -> str | None:
    """Why a request under `policy` decodes without speculation (None: it speculates)."""
    if policy.verifies:
        return (f"policy {policy.name} decodes on the fast path and verifies later; its requests decode "
                f"without speculation")
    if policy.deterministic and not policy.exact_attention:
        return f"policy {policy.name} recomputes every step in the verifier"
    return None


def propose(seq: Sequence, k: int) -> int:
    """Append up to k of the proposer's guesses to `seq` (the step's forward feeds them); their count."""
    stats = seq.speculation
    t = time.perf_counter()
    drafts = seq.proposer.propose(seq.tokens(0, seq.num_tokens), k)
    stats.seconds += time.perf_counter() - t
    seq.output_ids += drafts
    seq.drafted = len(drafts)
    return len(drafts)


def accept(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """The step's rows for [last token, d1..dm] came back: keep the drafts while they are what the
    request's sampling chooses at their position, then the first choice that differs (or the one
    after the last draft). Returns the rows whose choices were kept."""
    m, stats = seq.drafted, seq.speculation
    base = seq.num_tokens - m   # the position d1 takes
    drafts = seq.output_ids[base - seq.prompt_len:]
    chosen = scores(seq, logits, base).argmax(-1).tolist()  # row i: penalties see d1..di, as plain decoding
    keep = []
    for i, token in enumerate(chosen):
        keep.append(token)
        stop = token in seq.stop_ids and not seq.request.ignore_eos
        if i == m or token != drafts[i] or stop:
            break
    del seq.output_ids[base - seq.prompt_len:]
    seq.output_ids += keep
    seq.drafted = 0
    accepted = sum(1 for a, b in zip(keep, drafts) if a == b)
    stats.steps, stats.proposed, stats.accepted = stats.steps + 1, stats.proposed + m, stats.accepted + accepted
    return logits[:len(keep)]
