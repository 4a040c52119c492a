"""The `draft` proposer: a smaller model with the same tokenizer guesses the next k tokens greedily.

The draft runs on the invariant kernels in its own KV pool, one block table per speculating request,
and keeps the K/V of the tokens it has seen: each step it feeds only what the target accepted
since (after the longest common prefix with what it cached) and then k - 1 single-row steps.
Its guesses only decide how many tokens a step keeps; the target's rows decide which, so a
wrong or slow draft costs speed, never a token.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..kernels.choice import KernelChoice
from ..models.decoder import DecoderModel
from ..models.kv_cache import BlockTable
from ..options.engine import EngineConfig
from ..options.speculative import SpeculativeError
from .pool import build_pool
from .proposers import Proposer
from .runner import Runner, Span
from .sampling import choose
from .sequence import Request, Sequence


def check_draft(target_vocab: int, draft_vocab: int, same_tokenizer: bool) -> None:
    """A draft must share the target's tokenizer: its ids are proposed as the target's."""
    if draft_vocab != target_vocab:
        raise SpeculativeError("draft_model", f"the draft model's vocabulary has {draft_vocab} tokens, the "
                                              f"target's {target_vocab}: a draft must share the tokenizer")
    if not same_tokenizer:
        raise SpeculativeError("draft_model", "the draft model's tokenizer differs from the target's: a draft "
                                              "must share the tokenizer")


class DraftModel:
    """A loaded draft model and its KV pool, shared by the requests that speculate with it."""

    def __init__(self, model: DecoderModel, config: EngineConfig):
        # sized as the target's pool is (engine/pool.py), in bf16: reserved, pages resident as used
        self.kv = build_pool(model, replace(config, kv_cache_dtype="bfloat16"))
        self.runner = Runner(model, self.kv)

    def proposer(self) -> DraftProposer:
        return DraftProposer(self, BlockTable.empty(self.kv))


class DraftProposer(Proposer):
    _ids = 0

    def __init__(self, draft: DraftModel, table: BlockTable):
        self.draft, self.table = draft, table
        self.cached: list[int] = []   # tokens whose K/V the table holds, in order
        DraftProposer._ids += 1
        self.name = f"draft-{DraftProposer._ids}"

    def propose(self, tokens: list[int], k: int) -> list[int]:
        common = 0
        for a, b in zip(self.cached, tokens[:-1]):  # the last token is fed again: its row gives d1
            if a != b:
                break
            common += 1
        # a named id: the draft's sequences take none from the counter of the user's requests
        mirror = Sequence(Request(list(tokens), request_id=self.name), policy=None,
                          stop_ids=frozenset(), cache=self.table)
        drafts, start = [], common
        for _ in range(k):
            drafts.append(choose(mirror, self._forward(mirror, start), mirror.last_fed_pos).tokens[0])  # greedy
            start = mirror.next_pos
            mirror.output_ids.append(drafts[-1])
        self.cached = mirror.tokens(0, mirror.last_fed_pos)  # the last draft was never fed
        return drafts

    def _forward(self, mirror: Sequence, start: int) -> torch.Tensor:
        """The row of the last token, fed with those from `start` on."""
        span = Span(mirror, start, mirror.next_pos, exact_attention=True, kernel_choice=KernelChoice.INVARIANT)
        return self.draft.runner.forward([span], torch.bfloat16, KernelChoice.INVARIANT)[0]

    def close(self) -> None:
        self.table.free()
