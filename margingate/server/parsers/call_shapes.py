"""The shapes a tool call is written in, read whole: a `<tool_call>` block's JSON (`{"name", "arguments"}`;
"parameters" is vLLM's spelling), or a JSON object that is exactly a call (in a Markdown fence, or the whole
answer). A call's arguments are the text the model wrote for them where it writes its name first (what a
stream sends as it comes: `call_parser.py`), else their parsed value written out (a JSON string: decoded)."""
from __future__ import annotations

import json
import re

from .tool_format import CLOSE

# a block's JSON up to its arguments' value (which opens with { or ")
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{"])')


class JsonValue:
    """Finds where a JSON object or string ends, fed in pieces (depth and strings tracked)."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def scan(self, text: str) -> int:
        """How much of `text` belongs to the value (all of it unless the value ends inside)."""
        for i, ch in enumerate(text):
            if self.escape:
                self.escape = False
            elif self.in_string:
                self.escape, self.in_string = ch == "\\", ch != '"'
                if not self.in_string and self.depth == 0:
                    self.done = True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            if self.done:
                return i + 1
        return len(text)


def arguments_text(arguments) -> str:
    # arguments the model wrote as a JSON string are that string, not encoded a second time
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def raw_arguments(body: str) -> str | None:
    """The arguments as the block wrote them, where it writes its name then its arguments (else None)."""
    head = HEAD.match(body)
    if head is None:
        return None
    value = body[head.end():]
    end = JsonValue().scan(value)
    return value[:end] if not value.startswith('"') else None


def read_block(body: str, closed: bool, names: set[str]) -> tuple[tuple[str, str] | None, str | None]:
    """A block's call (name, arguments text), or why it is none."""
    if not closed:
        return None, f"no closing {CLOSE}"
    try:
        call = json.loads(body)
    except ValueError as exc:
        return None, f"not JSON: {exc}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, 'not an object with a "name"'
    if call["name"] not in names:
        return None, f"{call['name']!r} is not one of the tools"
    arguments = call.get("arguments", call.get("parameters", {}))  # "parameters": vLLM's spelling
    if not isinstance(arguments, (dict, str)):
        return None, "arguments are not a JSON object"
    raw = raw_arguments(body) if isinstance(arguments, dict) else None
    return (call["name"], raw if raw is not None else arguments_text(arguments)), None


def loose_call(body: str, names: set[str]) -> tuple[str, str] | None:
    """The call a fenced (or bare) JSON object states, or None where it is not exactly a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or set(obj) - {"name", "arguments", "parameters"}:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if not isinstance(arguments, (dict, str)):
        return None
    raw = raw_arguments(body) if isinstance(arguments, dict) else None
    return obj["name"], raw if raw is not None else arguments_text(arguments)
