"""One request's events, from the engine thread (worker.py) to its HTTP handler, read by name; the handle the
handler holds them by; and the per-choice accumulator that whole and streamed answers alike fill from them.

Events, in order: `accepted` (the engine took the request) or `error`; then `prompt` (the prompt's logprobs,
once prefilled: requests that ask, echo), `tokens` (newly released tokens, only what the policy releases: their
ids, logprobs (empty unless asked for), text (engine/detokenize.py: cut before a stop string) and where each
token's text begins), and last `done` (the Result) or `error` (status, message); nothing follows those two.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ...engine import Request, Result
from ...engine.events import StreamEvent
from ..parsers.answer import Answer, PlainParser
from ..parsers.call_parser import Piece
from ..protocol.common import OPENAI_FINISH


@dataclass(frozen=True)
class Event:
    kind: Literal["accepted", "prompt", "tokens", "done", "error"]
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)        # one TokenLogprob per id (if asked)
    text: str = ""
    offsets: list[int] = field(default_factory=list)    # where each id's text begins
    prompt_logprobs: list | None = None
    result: Result | None = None
    status: int = 0                                     # an error's HTTP status and message
    message: str = ""

    @classmethod
    def tokens(cls, event: StreamEvent) -> Event:
        return cls("tokens", list(event.token_ids), list(event.logprobs or []), event.text,
                   list(event.text_offsets or []))

    @classmethod
    def error(cls, status: int, message: str) -> Event:
        return cls("error", status=status, message=message)

    @property
    def last(self) -> bool:
        return self.kind in ("done", "error")

    @property
    def finish_reason(self) -> str:
        """A `done` event's finish reason, as OpenAI names it."""
        return OPENAI_FINISH.get(self.result.finish_reason, "stop")


@dataclass
class Outcome:
    """What one choice produced, as the client sees it: the events taken in order, and its text read by the
    answer's parser into the answer (content, calls: answer.py)."""
    parser: Any = field(default_factory=PlainParser)
    answer: Answer = field(default_factory=Answer)
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)   # where each id's text begins (completions' logprobs)
    prompt_logprobs: list | None = None
    reason: str | None = None
    result: Result | None = None

    def take(self, event: Event) -> list[Piece]:
        """Takes the event; the answer's pieces it decided (what a stream sends of it)."""
        pieces: list[Piece] = []
        if event.kind == "prompt":
            self.prompt_logprobs = event.prompt_logprobs
        elif event.kind == "tokens":
            self.text += event.text
            self.ids += event.ids
            self.logprobs += event.logprobs
            self.offsets += event.offsets
            pieces = self.parser.feed(event.text)
        elif event.kind == "done":
            self.reason, self.result = event.finish_reason, event.result
            pieces = self.parser.finish()
        self.answer.take(pieces)
        return pieces

    @property
    def reasoning_tokens(self) -> int:
        """The tokens whose text begins inside the answer's reasoning (reasoning.py; 0: none)."""
        end = getattr(self.parser, "reasoning_end", 0)
        return sum(1 for offset in self.offsets if offset < end)

    @property
    def finish_reason(self) -> str | None:
        """As the client reads it: "tool_calls" where a finished answer called a tool."""
        return self.answer.finish_reason(self.reason)


@dataclass(eq=False)
class Handle:
    """One submitted request, as the HTTP side sees it."""
    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float = field(default_factory=time.perf_counter)
    seq: Any = None                     # the engine's Sequence, once added (engine thread only)
    first_token: float | None = None
    admitted: bool = False
    closed: bool = False                # the last event was posted
    weights_from: tuple[int, int] | None = None  # kept across a weight swap: (the version before, tokens chosen)

    @property
    def request_id(self) -> str:
        return self.request.request_id
