"""gpt-oss's harmony format: an answer as messages on channels, read into `reasoning_content`, content and calls.

After the generation prompt (`<|start|>assistant`) a harmony model writes one or more messages, each a header,
`<|message|>`, a body and an end mark:

    <|channel|>analysis<|message|>We need the weather...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"X"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The header names the message's channel and, for a call, its recipient (`to=functions.NAME`, before or after the
channel). The `analysis` channel is the model's reasoning (`reasoning_content`); a message to
`functions.NAME` (an offered tool, within the calls allowed) is a call whose arguments are its body; every other
message (`final`, `commentary` without a recipient) is content. The structural marks are special tokens, so a
harmony model's text keeps its special tokens (`engine/detokenize.decode_text`). Pieces go out as the text
comes (`call_parser.Piece`): a body streams, and only a tail that could still open an end mark is held.

`grammar` holds a forced call (`tool_choice` required or a named function) to the format: one commentary
message to an offered function, its body the function's JSON arguments.
"""
from __future__ import annotations

import json
import re

from .call_parser import Piece, held_prefix
from .tool_format import call_schema, closed, parameters

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
ENDS = (END, CALL, RETURN, START)  # what closes a body (a new message's start too)
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


class HarmonyParser:
    """One answer's messages, as its text comes (`feed`, then `finish`): analysis as reasoning, calls to offered
    functions as calls (at most `limit`), the rest as content."""

    def __init__(self, names: set[str], limit: int):
        self.names, self.limit = names, limit
        self.buf, self.kind, self.calls, self.index = "", None, 0, 0  # kind None: reading a header

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if self.kind is None:
                at = self.buf.find(MESSAGE)
                if at < 0:
                    return out
                out += self._open(self.buf[:at])
                self.buf = self.buf[at + len(MESSAGE):]
            ends = [(i, m) for m in ENDS if (i := self.buf.find(m)) >= 0]
            if not ends:
                keep = held_prefix(self.buf, *ENDS)
                out += self._body(self.buf[:keep])
                self.buf = self.buf[keep:]
                return out
            at, mark = min(ends)
            out += self._body(self.buf[:at])
            self.buf = self.buf[at + (0 if mark == START else len(mark)):]
            self.kind = None

    def finish(self) -> list[Piece]:
        """The rest: a body cut off (max_tokens) as far as it went; a header without a body as content (a
        model that wrote no harmony)."""
        rest, self.buf = self.buf, ""
        if self.kind is None:
            text = rest.replace(START + "assistant", "").strip()
            return [Piece("text", text)] if text else []
        return self._body(rest)

    def _open(self, header: str) -> list[Piece]:
        """A message's header read: its kind, and a call's opening piece."""
        recipient = RECIPIENT.search(header)
        channel = CHANNEL_NAME.search(header)
        name = recipient[1].removeprefix("functions.") if recipient and recipient[1].startswith("functions.") else None
        if name is not None and name in self.names and self.calls < self.limit:
            self.kind, self.index = "args", self.calls
            self.calls += 1
            return [Piece("call", index=self.index, name=name)]
        self.kind = "reasoning" if channel and channel[1] == "analysis" else "text"
        return []

    def _body(self, text: str) -> list[Piece]:
        if not text:
            return []
        return [Piece(self.kind, text, index=self.index)] if self.kind == "args" else [Piece(self.kind, text)]


def grammar(tools, marks: frozenset[str] = frozenset()) -> str:
    """Lark for one call of any of `tools` in harmony's form (`tools` already narrowed to the named one). `marks`:
    the harmony marks the tokenizer holds as one special token, named as that token rather than spelled."""
    def mark(m: str) -> str:
        return m if m in marks else json.dumps(m)

    lines = ["start: " + " | ".join(f"call{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        head = json.dumps(f"commentary to=functions.{tool.function.name} ")
        lines.append(f'call{i}: {mark(CHANNEL)} {head} {mark(CONSTRAIN)} "json" {mark(MESSAGE)} body{i}')
        lines.append(f"body{i}: %json {json.dumps(_arguments_schema(tool))}")
    return "\n".join(lines) + "\n"


def _arguments_schema(tool) -> dict:
    """The call's arguments: the function's parameters, closed, written compact (as `tool_format.call_schema`)."""
    spacing = call_schema([])["x-guidance"]
    return {**closed(parameters(tool)), "x-guidance": spacing}
