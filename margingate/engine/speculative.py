"""Speculative decoding that cannot change a token: proposals checked by the invariant kernels.

A proposer guesses the next k tokens of a request. The engine feeds [last token, d1..dk] as one
span of the step's forward, through the invariant kernels with exact attention: each row's
logits are bitwise the logits of decoding that position alone (the kernels are row-independent),
so row i chooses, with the request's own sampling (seeded Gumbel noise keyed by position), the
token that plain decoding would choose after d1..di. The engine accepts drafts while they equal
those choices and emits the first choice that differs: the output is the plain output, fewer
passes over the weights.

The drafts wait in `seq.drafts`, never in the output: until `accept` commits them they count in no
length, stop condition or history, and a step that fails leaves the sequence as it was.

It applies to the policies that say so (`Policy.speculates`): those whose plain decode rows are already
canonical (`batch-invariant`, bf16 `reference`) and those that promise nothing either way (`fast`,
`fast-library`, `layercast`). A verifying policy decodes on the fast path and repairs later; its
requests decode without speculation, and the report says so.
"""
from __future__ import annotations

import time

import torch

from .sampling import RowChoices, choose
from .sequence import Sequence


def off_reason(policy, constrained: bool = False) -> str | None:
    """Why a request under `policy` decodes without speculation (None: it speculates). The policies that
    speculate say so (`Policy.speculates`): each accepted draft goes through their `commit` with no job."""
    if constrained:
        return "structured output: its mask is computed token by token"
    if policy.speculates:
        return None
    if policy.verifies:
        return (f"policy {policy.name} decodes on the fast path and verifies later; its requests decode "
                f"without speculation")
    return f"policy {policy.name} recomputes every step in the verifier"


def propose(seq: Sequence, k: int) -> int:
    """Up to k of the proposer's guesses into `seq.drafts` (the step's forward feeds them); their count."""
    stats = seq.speculation
    t = time.perf_counter()
    seq.drafts = seq.proposer.propose(seq.tokens(0, seq.next_pos), k)
    stats.seconds += time.perf_counter() - t
    return len(seq.drafts)


def accept(seq: Sequence, rows: torch.Tensor) -> RowChoices:
    """The step's rows for [last token, d1..dm] came back: commit the drafts while they are what the
    request's sampling chooses at their position, then the first choice that differs (or the one
    after the last draft). Returns what the rows chose (its tokens past the committed ones unused)."""
    drafts, stats = seq.drafts, seq.speculation
    choice = choose(seq, rows, seq.last_fed_pos, drafts)  # row i: penalties see d1..di, as plain decoding
    kept = 0
    for i, token in enumerate(choice.tokens):
        kept += 1
        stop = token in seq.stop_ids and not seq.request.ignore_eos
        if i == len(drafts) or token != drafts[i] or stop:
            break
    seq.drafts = []
    for i in range(kept):
        seq.policy.commit(seq, choice.row(i), None)
    accepted = sum(1 for a, b in zip(choice.tokens[:kept], drafts) if a == b)
    stats.steps, stats.proposed, stats.accepted = (stats.steps + 1, stats.proposed + len(drafts),
                                                   stats.accepted + accepted)
    return choice
