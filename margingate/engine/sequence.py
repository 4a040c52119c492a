"""A request as the engine sees it, and what comes back."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..options.sampling import SamplingParams
from ..options.speculative import SpeculativeConfig
from .proposers import Proposer, SpeculationStats

if TYPE_CHECKING:
    from ..models.kv_cache import BlockTable
    from .detokenize import Detokenizer
    from .logprobs import TokenLogprob
    from .structured import Matcher

_ids = itertools.count()


@dataclass
class Request:
    """What a caller submits. `prompt_ids` are already tokenized."""
    prompt_ids: list[int]
    max_new_tokens: int = 128
    # a Policy (engine/policy.py, the layer above: policies read sequences); None: the engine's default
    policy: Any = None
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS tokens
    ignore_eos: bool = False
    request_id: str | None = None
    arrival_step: int = 0                  # for replayable staggered arrivals in `generate`
    sampling: SamplingParams = SamplingParams()
    # the request id of a request with the same prompt (one of n samples): once that one's prompt is
    # prefilled, this one copies its K/V instead of computing them again (the same bits: prompts run
    # the invariant kernels)
    share_prefill: str | None = None
    speculative: SpeculativeConfig | None = None  # proposals checked by the invariant kernels (speculative.py)

    def __post_init__(self):
        self.sampling = self.sampling.seeded()
        if not self.prompt_ids:
            raise ValueError("empty prompt: at least one prompt token is required")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0 (0: score the prompt only), "
                             f"got {self.max_new_tokens!r}")
        if self.request_id is None:
            self.request_id = f"req-{next(_ids)}"


@dataclass
class Result:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any]
    cached_tokens: int = 0                 # prompt positions taken from the prefix cache
    logprobs: list[TokenLogprob] | None = None         # one per output token, if asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None)
    text: str | None = None                # cut before a stop string (detokenize.py); None: no tokenizer


@dataclass(eq=False)  # identity: two requests are never the same sequence
class Sequence:
    request: Request
    policy: Any                            # the request's Policy (engine/policy.py, which reads sequences)
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    cache: BlockTable | None = None        # this request's KV blocks, from admission until it leaves or is preempted
    prefilled: int = 0                     # positions whose K/V are written by the prompt path (prefill_end at most)
    # preempted with output: its K/V up to the last token are recomputed through the prompt path on readmission
    recompute: bool = False
    preemptions: int = 0
    cached_tokens: int = 0                 # of which copied from the prefix cache
    steps: int = 0                         # decode steps taken
    released: int = 0                      # output tokens already handed to the caller
    prompt_released: bool = False          # the prompt's logprobs were handed over (if asked)
    finish_reason: str | None = None
    state: Any = None                      # the policy's memory of this request (Policy.new_state)
    fork_of: Sequence | None = None        # `share_prefill`'s sequence, until its K/V are copied
    # logprobs of each output token, from the row that chose it, replaced by the verifier's
    # (canonical) row when one recomputes its position
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    speculation: SpeculationStats | None = None  # if the request speculates
    proposer: Proposer | None = None
    # this step's proposals (speculation), fed after the last token: not output, and not counted by
    # num_tokens, tokens() or should_stop, until `speculative.accept` keeps them
    drafts: list[int] = field(default_factory=list)
    detokenizer: Detokenizer | None = None  # the output's text and stop strings (engines with a tokenizer)
    grammar: Matcher | None = None         # the structured-output constraint's state (structured.py)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def prefill_end(self) -> int:
        """Where the prompt path stops: the prompt's end, or after a preemption every position but the last
        token's (whose K/V the next decode step writes)."""
        return self.num_tokens - 1 if self.recompute else self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_end

    def prefill_logits_rows(self, start: int, end: int) -> int:
        """How many of a prompt chunk's last rows come back as logits: all of them for prompt logprobs, else
        the prompt's last row (it chooses the first token); none while recomputing."""
        if self.recompute:
            return 0
        if self.request.sampling.prompt_logprobs is not None:
            return end - start
        return int(end == self.prompt_len)

    def preempted(self) -> None:
        """Its blocks were taken back: it waits to be readmitted, then recomputes its K/V (the output so far is
        kept; a prompt not yet complete starts over)."""
        self.cache, self.prefilled, self.drafts = None, 0, []
        self.preemptions += 1
        self.recompute = bool(self.output_ids)
        if not self.recompute:
            self.prompt_logprobs = []

    @property
    def next_pos(self) -> int:
        """The position the next chosen token takes."""
        return self.num_tokens

    @property
    def last_fed_pos(self) -> int:
        """The position a decode step feeds: the last token's, whose K/V that step writes and whose
        row chooses the token at `next_pos`."""
        return self.num_tokens - 1

    def token_at(self, pos: int) -> int:
        p = self.prompt_len
        return self.request.prompt_ids[pos] if pos < p else self.output_ids[pos - p]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end)."""
        return [self.token_at(p) for p in range(start, end)]

    def rollback(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (prompt included). The cache needs no write
        (positions are absolute and attention never reads past a row's length); the engine frees the
        blocks past the end after the step."""
        if num_tokens <= self.prompt_len:
            raise ValueError("the prompt is never rolled back: keep at least one output token")
        del self.output_ids[num_tokens - self.prompt_len:]
        del self.logprobs[num_tokens - self.prompt_len:]
        self.released = min(self.released, len(self.output_ids))
        if self.detokenizer is not None:
            self.detokenizer.rollback(len(self.output_ids))

    def appended(self) -> None:
        """Tokens were appended: their text, one token at a time; the output ends at the token completing
        a stop string (a speculative step or a release burst may hold tokens past it)."""
        if self.detokenizer is not None:
            keep = self.detokenizer.feed(self.output_ids)
            if keep is not None and keep < len(self.output_ids):
                self.rollback(self.prompt_len + keep)

    def should_stop(self, max_len: int) -> str | None:
        if self.detokenizer is not None and self.detokenizer.stop_at is not None:
            return "stop"
        if self.output_ids and not self.request.ignore_eos and self.output_ids[-1] in self.stop_ids:
            return "stop"
        if len(self.output_ids) >= self.request.max_new_tokens:
            return "length"
        if self.num_tokens >= max_len:
            return "context"
        return None
