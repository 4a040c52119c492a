"""What the engine reports: a request's released tokens after a step (`StreamEvent`), what it holds now
(`Load`), and its forwards' totals by kind (`PhaseTotals`)."""
from __future__ import annotations

from dataclasses import dataclass

from .sequence import Result


@dataclass
class PhaseTotals:
    """Forwards of one kind since the engine started: how many, their rows, their time."""
    calls: int = 0
    rows: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class Load:
    """What the engine holds now: requests waiting for KV blocks, requests holding some, and the pool."""
    waiting: int
    running: int
    blocks_used: int       # held by requests (a block shared by several counts once)
    blocks_free: int
    blocks_cached: int     # held by the prefix cache alone: freed when needed
    preemptions: int       # since the engine started


@dataclass
class StreamEvent:
    """What one request hands its caller after a step (`Engine.release`)."""
    request_id: str
    token_ids: list[int]          # newly released tokens
    finished: bool
    result: Result | None = None
    logprobs: list | None = None  # the new tokens' logprobs, if the request asked
    prompt_logprobs: list | None = None  # once, when its prompt is prefilled, if the request asked
    text: str = ""                # the new text (detokenize.py): the deltas add up to the result's text
    text_offsets: list[int] | None = None  # where each new token's text begins (completions' logprobs)
