"""One choice's answer as the client reads it, built from the parser's pieces (`call_parser.py`): its content,
its tool calls (each with its id, given when the call opens, so a stream and its last event name the same
call) and where its message stands among the calls (the Responses' output order). Whole and streamed answers
fill it alike; a stream sends each piece as it is taken."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .call_parser import Piece


class PlainParser:
    """An answer without tools: its text is its content, as it comes."""

    def feed(self, text: str) -> list[Piece]:
        return [Piece("text", text)]

    def finish(self) -> list[Piece]:
        return []


@dataclass
class Answer:
    stripped: bool = False              # content None where it is empty (an answer with tools)
    content: str = ""
    reasoning: str | None = None
    calls: list[dict] = field(default_factory=list)
    message_at: int | None = None       # how many calls opened before the first content
    # the answer as written, in turns: ["reasoning" | "text", its text] or ["call", its index]
    segments: list[list] = field(default_factory=list)

    def take(self, pieces: list[Piece]) -> None:
        for p in pieces:
            self._segment(p)
            if p.kind == "text":
                if self.message_at is None and p.text:
                    self.message_at = len(self.calls)
                self.content += p.text
            elif p.kind == "reasoning":
                self.reasoning = (self.reasoning or "") + p.text
            elif p.kind == "call":
                self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                   "function": {"name": p.name, "arguments": ""}})
            else:
                self.calls[p.index]["function"]["arguments"] += p.text

    def _segment(self, p: Piece) -> None:
        if p.kind == "call":
            self.segments.append(["call", p.index])
        elif p.kind in ("text", "reasoning") and p.text:
            if self.segments and self.segments[-1][0] == p.kind:
                self.segments[-1][1] += p.text
            else:
                self.segments.append([p.kind, p.text])

    def message(self) -> dict:
        """The assistant message's fields: content, reasoning_content where it reasoned, tool_calls where it
        called any."""
        empty = self.stripped or self.reasoning is not None  # None where there is nothing (calls, reasoning)
        out = {"content": (self.content or None) if empty else self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.calls:
            out["tool_calls"] = self.calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
