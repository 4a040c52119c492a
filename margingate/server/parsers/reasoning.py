"""Reasoning models' answers: the reasoning a template family marks (`<think>...</think>`: Qwen3, DeepSeek-R1's
distills, SmolLM3) goes to `reasoning_content` (a Responses `reasoning` item), the rest is the answer.

Where the answer starts is read from the prompt the template made: after an opened `<think>` (R1's templates
open it in the generation prompt) the answer starts inside its reasoning; after a closed one at its end (Qwen3
with `chat_template_kwargs: {"enable_thinking": false}` writes an empty one) there is none; otherwise the
model may open one with its first text. The parser splits the text as it is released, so a stream's
`reasoning_content` deltas are the whole answer's reasoning, bitwise; an output constraint (a JSON schema, the
tools' grammar) holds the answer only after the reasoning ends (`engine/structured.AfterReasoning`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .call_parser import Piece, Trim, held_prefix

# a template family's reasoning marks: (opening, closing)
FAMILIES = {"think": ("<think>", "</think>")}


def template_family(chat_template: str | None, writes_harmony: bool = False) -> str | None:
    """The reasoning family a chat template writes (None: its answers have no reasoning); "harmony": gpt-oss's
    analysis channel (harmony.py reads the whole answer), as the tokenizer found it (`Tokenizer.harmony`)."""
    if writes_harmony:
        return "harmony"
    if not chat_template:
        return None
    return next((name for name, (_, closing) in FAMILIES.items() if closing in chat_template), None)


@dataclass(frozen=True)
class Reasoning:
    """How one answer's reasoning is marked, and whether the answer starts inside it."""
    opening: str
    closing: str
    inside: bool
    harmony: bool = False  # gpt-oss's channels: the answer is read by harmony.HarmonyParser

    @classmethod
    def of(cls, family: str | None, prompt_tail: str) -> Reasoning | None:
        """The answer's reasoning after a prompt ending in `prompt_tail` (None: no reasoning to read)."""
        if family is None:
            return None
        if family == "harmony":
            return cls("", "", inside=False, harmony=True)
        opening, closing = FAMILIES[family]
        opened, closed = prompt_tail.rfind(opening), prompt_tail.rfind(closing)
        if opened > closed:
            return cls(opening, closing, inside=True)
        if closed >= 0 and not prompt_tail[closed + len(closing):].strip():
            return None  # an empty reasoning closed in the prompt: thinking is off
        return cls(opening, closing, inside=False)


class ReasoningParser:
    """Splits the answer's reasoning from its rest, as the text comes; the rest goes on to `inner` (content and
    calls). The reasoning is trimmed at its ends, and so is the whitespace that follows its closing."""

    def __init__(self, reasoning: Reasoning, inner):
        self.r, self.inner = reasoning, inner
        self.mode: Literal["start", "reasoning", "answer"] = "reasoning" if reasoning.inside else "start"
        self.buf, self.trim = "", Trim()
        self.after = True   # the whitespace after the closing is dropped
        self.fed = 0        # characters of the answer's text fed so far
        self.ended: int | None = None  # where the reasoning ended in the answer's text (its closing's end)

    @property
    def reasoning_end(self) -> int:
        """How many characters of the answer's text are its reasoning (marks included) so far."""
        return self.ended if self.ended is not None else self.fed if self.mode == "reasoning" else 0

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        self.fed += len(text)
        out: list[Piece] = []
        if self.mode == "start":
            stripped = self.buf.lstrip()
            if not stripped or (self.r.opening.startswith(stripped) and stripped != self.r.opening):
                return out  # may still open its reasoning
            if stripped.startswith(self.r.opening):
                self.buf, self.mode = stripped[len(self.r.opening):], "reasoning"
            else:
                self.mode, self.after = "answer", False
        if self.mode == "reasoning":
            end = self.buf.find(self.r.closing)
            cut = end if end >= 0 else held_prefix(self.buf, self.r.closing)
            out += self._reasoning(self.buf[:cut])
            if end < 0:
                self.buf = self.buf[cut:]
                return out
            self.ended = self.fed - len(self.buf) + end + len(self.r.closing)
            self.buf, self.mode = self.buf[end + len(self.r.closing):], "answer"
        return out + self._answer()

    def finish(self) -> list[Piece]:
        self.after = self.after and self.mode != "start"  # an answer that never opened its reasoning is as it came
        out = self._reasoning(self.buf) if self.mode == "reasoning" else self._answer()
        self.buf = ""
        return out + self.inner.finish()

    def _reasoning(self, text: str) -> list[Piece]:
        kept = self.trim.take(text)
        return [Piece("reasoning", kept)] if kept else []

    def _answer(self) -> list[Piece]:
        text, self.buf = self.buf, ""
        if self.after:
            text = text.lstrip()
            self.after = not text
        return self.inner.feed(text) if text else []
