"""An answer's text, as the engine releases it, split into content and tool calls (`tools.py` says which shapes
are calls): pieces go out as soon as they are decided, so a stream sends a call's name, then its arguments
in fragments as the tokens arrive, and a whole answer is the same parser given the whole text.

Pieces: `text` (content), `call` (a call opens: its index and name) and `args` (a fragment of that call's
arguments). A call's arguments are the text the model wrote for them (a JSON object as written, or a JSON
string decoded), so the fragments a stream sent, joined, are bitwise the arguments of the whole answer.

- A `<tool_call>` block whose JSON opens with `"name"` (an offered tool, within the calls allowed) and then
  `"arguments"` (or `"parameters"`) streams: the name once read, the arguments' object as it grows. Any
  other block is held until it closes and read whole: a call, or content behind a marker.
- A fenced JSON object, or the whole answer as one, that is exactly a call is held until it closes and
  goes out whole.
- Content is stripped at its two ends (whitespace is held until text follows it), and text that could
  still open a block or a fence is held until it does or cannot.

Streamed and whole agree on every answer whose blocks are well formed. A block that streamed its name and
then turns out malformed (cut off by max_tokens, or not JSON at its end) stays a call in the stream, its
arguments as far as they went, while the whole answer, which sees the block at once, keeps it in content
behind the marker.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from . import tool_format
from .call_shapes import HEAD, JsonValue, loose_call, read_block

OPEN, CLOSE, FENCE = tool_format.OPEN, tool_format.CLOSE, "```"
FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\n")
FENCE_BODY = re.compile(r"(.*?)\n?```", re.DOTALL)


@dataclass(frozen=True)
class Piece:
    kind: Literal["text", "reasoning", "call", "args"]
    text: str = ""       # text, reasoning, or an arguments fragment
    index: int = 0       # a call's index in the answer
    name: str = ""       # a call's function


class Trim:
    """Text with the whitespace at its two ends dropped, as it comes: whitespace is held until text follows."""

    def __init__(self):
        self.ws, self.started = "", False

    def take(self, text: str) -> str:
        """What goes out of `text` now."""
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            if self.started:
                self.ws += text
            return ""
        out, self.ws, self.started = self.ws + body, text[len(body):], True
        return out


def held_prefix(text: str, *marks: str) -> int:
    """Where the longest end of `text` that could begin one of `marks` starts (len(text): none)."""
    for start in range(max(0, len(text) - max(map(len, marks)) + 1), len(text)):
        if any(m.startswith(text[start:]) for m in marks):
            return start
    return len(text)


class CallParser:
    """Content and calls of one answer; `feed` its text in order, then `finish`. `whole`: the text comes at once
    (a block is never streamed, so one that turns out malformed stays content)."""

    def __init__(self, names: set[str], limit: int, whole: bool = False):
        self.names, self.limit, self.whole = names, limit, whole
        self.mode = "start"   # start | text | fence | code | block | args | tail | bare
        self.buf = ""         # text not decided yet
        self.calls = 0
        self.value = JsonValue()
        self.scanned = 0      # how much of a bare answer the value scanner has read
        self.raw_string: str | None = None  # arguments written as a JSON string: decoded once whole
        self.trim = Trim()
        self.out: list[Piece] = []

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        while self.buf and self._step():
            pass
        return self._take()

    def finish(self) -> list[Piece]:
        if self.mode == "bare":
            self._bare()
        if self.mode in ("text", "fence", "code"):
            self._text(self.buf)
        elif self.mode == "block":
            self._read_block(self.buf, closed=False)
        elif self.mode == "args":
            self._args(self.buf)
        self.buf, self.mode = "", "text"
        return self._take()

    def _take(self) -> list[Piece]:
        out, self.out = self.out, []
        return out

    # --- content ---------------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        """Content; whitespace at either end of the answer's content is dropped (held until text follows)."""
        kept = self.trim.take(text)
        if kept:
            self.out.append(Piece("text", kept))

    def _call(self, name: str, arguments: str | None = None) -> None:
        self.out.append(Piece("call", index=self.calls, name=name))
        if arguments:
            self.out.append(Piece("args", arguments, index=self.calls))
        self.calls += 1

    def _args(self, fragment: str) -> None:
        if fragment:
            self.out.append(Piece("args", fragment, index=self.calls - 1))

    # --- the modes: each takes what it can decide from the buffer; False when it must wait ----------
    def _step(self) -> bool:
        return getattr(self, f"_{self.mode}_mode")()

    def _start_mode(self) -> bool:
        stripped = self.buf.lstrip()
        if not stripped:
            return False
        self.mode = "bare" if stripped.startswith("{") and self.limit else "text"
        return True

    def _bare_mode(self) -> bool:
        """An answer that opens with an object may be one call: held while it still may be."""
        if not self.value.done:
            self.scanned += self.value.scan(self.buf[self.scanned:])
            if not self.value.done:
                return False
        if loose_call(self.buf[:self.scanned], self.names) is not None and not self.buf[self.scanned:].strip():
            return False  # a call, if nothing follows it
        self.mode = "text"
        return True

    def _bare(self) -> None:
        call = loose_call(self.buf, self.names)
        if call is not None:
            self._call(*call)
            self.buf = ""
        self.mode = "text"
        while self.buf and self._step():
            pass

    def _text_mode(self) -> bool:
        found = [i for i in (self.buf.find(OPEN), self.buf.find(FENCE)) if i >= 0]
        if not found:
            cut = held_prefix(self.buf, OPEN, FENCE)
            self._text(self.buf[:cut])
            self.buf = self.buf[cut:]
            return False
        at = min(found)
        self._text(self.buf[:at])
        if self.buf.startswith(OPEN, at):
            self.buf, self.mode = self.buf[at + len(OPEN):], "block"
        else:
            self.buf, self.mode = self.buf[at:], "fence"
        return True

    def _fence_mode(self) -> bool:
        """A fence: a call if its body is exactly one, else text as it came."""
        opening = FENCE_OPEN.match(self.buf)
        if opening is None:
            rest = self.buf[len(FENCE):]
            if "\n" not in rest and could_open_fence(rest):
                return False
            self._text(FENCE)
            self.buf, self.mode = rest, "text"
            return True
        first = self.buf[opening.end():].lstrip()
        if first and not first.startswith("{"):  # code, no call: it streams as text up to its closing fence
            self._text(self.buf[:opening.end()])
            self.buf, self.mode = self.buf[opening.end():], "code"
            return True
        body = FENCE_BODY.match(self.buf, opening.end())
        if body is None:
            return False
        call = loose_call(body.group(1), self.names) if self.calls < self.limit else None
        if call is not None:
            self._call(*call)
        else:
            self._text(self.buf[:body.end()])
        self.buf, self.mode = self.buf[body.end():], "text"
        return True

    def _code_mode(self) -> bool:
        end = self.buf.find(FENCE)
        cut = end + len(FENCE) if end >= 0 else held_prefix(self.buf, FENCE)
        self._text(self.buf[:cut])
        self.buf = self.buf[cut:]
        self.mode = "text" if end >= 0 else "code"
        return end >= 0

    def _block_mode(self) -> bool:
        end = self.buf.find(CLOSE)
        if end >= 0:
            self._read_block(self.buf[:end], closed=True)
            self.buf, self.mode = self.buf[end + len(CLOSE):], "text"
            return True
        head = None if self.whole else HEAD.match(self.buf)
        if head is None or head.group(1) not in self.names or self.calls >= self.limit:
            return False  # read whole once it closes
        self._call(head.group(1))
        self.buf, self.mode, self.value = self.buf[head.end():], "args", JsonValue()
        self.raw_string = "" if self.buf.startswith('"') else None
        return True

    def _args_mode(self) -> bool:
        """The arguments as they come, up to their value's end (or a closing tag that cuts them)."""
        close = self.buf.find(CLOSE)
        limit = close if close >= 0 else held_prefix(self.buf, CLOSE)
        taken = self.value.scan(self.buf[:limit])
        fragment, self.buf = self.buf[:taken], self.buf[taken:]
        if self.raw_string is not None:
            self.raw_string += fragment
            if self.value.done:
                self._args(json.loads(self.raw_string))
        else:
            self._args(fragment)
        if self.value.done:
            self.mode = "tail"
        elif close >= 0:  # cut before its end: the call stands as far as it went
            self.buf, self.mode = self.buf[len(CLOSE):], "text"
        return self.value.done or close >= 0

    def _tail_mode(self) -> bool:
        """After the arguments: the rest of the block is dropped."""
        end = self.buf.find(CLOSE)
        if end < 0:
            self.buf = self.buf[held_prefix(self.buf, CLOSE):]
            return False
        self.buf, self.mode = self.buf[end + len(CLOSE):], "text"
        return True

    def _read_block(self, body: str, closed: bool) -> None:
        call, why = read_block(body, closed, self.names)
        if call is not None and self.calls >= self.limit:
            call, why = None, f"more than {self.limit} call{'s' if self.limit > 1 else ''} (parallel_tool_calls)"
        if call is not None:
            self._call(*call)
        else:
            self._text(f"[margingate: not a tool call ({why})]\n{OPEN}{body}{CLOSE if closed else ''}")


def could_open_fence(rest: str) -> bool:
    """Whether the text after ``` may still become a JSON fence's opening line."""
    if "json".startswith(rest):
        return True
    return not rest.removeprefix("json").strip(" \t")
