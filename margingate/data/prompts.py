"""Prompt records and loaders for JSON-lines prompt files.

Each non-blank line of a prompt file is a JSON object in one of three forms:

    {"prompt": "..."}                                  one user message (chat)
    {"messages": [{"role": ..., "content": ...}, ...]} a full conversation (chat)
    {"text": "..."}                                    raw text completion

Any other keys (e.g. "category") are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

_ROLES = ("system", "user", "assistant")
_FORMS = ("prompt", "messages", "text")
_BUILTIN_FILE = "builtin_prompts.jsonl"


class PromptFileError(ValueError):
    """A prompt file or record is missing or malformed."""


@dataclass(frozen=True)
class Prompt:
    kind: str  # "chat" (messages set; chat template applies) or "text" (text set)
    messages: tuple[dict, ...] | None
    text: str | None
    source: str  # where it came from, e.g. "builtin:3" or "prompts.jsonl:12"

    def display(self, width: int = 60) -> str:
        """One-line preview: the first user message (or raw text), truncated."""
        if self.kind == "text":
            s = self.text or ""
        else:
            msgs = self.messages or ()
            users = [m["content"] for m in msgs if m["role"] == "user"]
            s = users[0] if users else (msgs[-1]["content"] if msgs else "")
        s = " ".join(s.split())
        return s if len(s) <= width else s[: width - 1] + "…"


def _nonempty_str(value) -> bool:
    return isinstance(value, str) and value.strip() != ""


def parse_prompt_record(obj, source: str) -> Prompt:
    """Turn one decoded JSON record into a Prompt; raise PromptFileError if invalid."""

    def fail(problem: str):
        raise PromptFileError(f"{source}: {problem}")

    if not isinstance(obj, dict):
        fail(f"expected a JSON object, got {type(obj).__name__}")
    present = [k for k in _FORMS if k in obj]
    if not present:
        fail('expected one of "prompt", "messages" or "text"')
    if len(present) > 1:
        fail(f"expected only one of \"prompt\", \"messages\" or \"text\", got {present}")

    key = present[0]
    value = obj[key]
    if key in ("prompt", "text"):
        if not _nonempty_str(value):
            fail(f'"{key}" must be a non-empty string')
        if key == "text":
            return Prompt("text", None, value, source)
        return Prompt("chat", ({"role": "user", "content": value},), None, source)

    # "messages": a non-empty list of {"role", "content"} objects.
    if not isinstance(value, list) or not value:
        fail('"messages" must be a non-empty list')
    messages = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            fail(f"messages[{i}] must be an object")
        if msg.get("role") not in _ROLES:
            fail(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {msg.get('role')!r}")
        if not _nonempty_str(msg.get("content")):
            fail(f"messages[{i}].content must be a non-empty string")
        messages.append({"role": msg["role"], "content": msg["content"]})
    return Prompt("chat", tuple(messages), None, source)


def _parse_lines(lines: Iterable[str], name: str) -> list[Prompt]:
    """Parse JSON lines (blank lines skipped); sources are "<name>:<line number>".

    Callers split on "\\n" only (not str.splitlines, which also breaks on
    characters such as U+2028 that may legally appear inside JSON strings).
    """
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        source = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{source}: invalid JSON: {e}") from None
        prompts.append(parse_prompt_record(obj, source))
    if not prompts:
        raise PromptFileError(f"{name}: no prompts found")
    return prompts


def load_prompts_file(path) -> list[Prompt]:
    """Load prompts from a JSON-lines file."""
    path = Path(path)
    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PromptFileError(f"prompt file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"cannot read prompt file {path}: {e}") from None
    return _parse_lines(content.split("\n"), str(path))


def builtin_prompts() -> list[Prompt]:
    """The prompt set shipped with margingate (margingate/data/builtin_prompts.jsonl)."""
    content = resources.files(__package__).joinpath(_BUILTIN_FILE).read_text(encoding="utf-8")
    return _parse_lines(content.split("\n"), "builtin")


def builtin_text() -> str:
    """The built-in prompts' words, one after another: real text of any length for long-context and
    quality measurements (repeat it)."""
    return "\n\n".join(p.text or "\n".join(m["content"] for m in p.messages) for p in builtin_prompts())
