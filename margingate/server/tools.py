"""Tool calls on chat completions: `tools` and `tool_choice` in, OpenAI's `tool_calls` out.

- `required` and a named function are enforced by the grammar (`structured.py`), so they always
  parse. A named function's output is its arguments, a JSON object of its `parameters` schema;
  `required`'s is a JSON array of one or more {"name", "parameters"} objects, one of the tools each
  (vLLM's formats).
- `auto` uses the chat template's own tool format where the model's template defines one (the
  Hermes `<tool_call>{...}</tool_call>` blocks of Qwen, Hermes and SmolLM3): the template is given
  the tools and the answer's blocks are parsed. A template with none is a 400 that says so.
- `none` (and no tools): plain text.

Messages carry calls back: an assistant message's `tool_calls` and `role: tool` answers. A template
with a tool format renders them itself; for one without, an assistant's calls are written as the
`required` array the model produced, so an agent loop gives the model back its own tokens.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ..options.structured import StructuredOutput
from .formats import NamedToolChoice, Tool
from .protocol import BadRequest

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_format(chat_template: str | None) -> str | None:
    """The tool format the model's chat template defines: "hermes", or None."""
    return "hermes" if chat_template and "tools" in chat_template and "<tool_call>" in chat_template else None


def mode(params) -> str:
    """"none", "auto", "required" or "named" (a named function); checks the names."""
    choice = params.tool_choice
    if not params.tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", param="tool_choice")
        return "none"
    names = [t.function.name for t in params.tools]
    if len(set(names)) != len(names):
        raise BadRequest("tools: function names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not one of the tools",
                             param="tool_choice.function.name")
        return "named"
    return choice or "auto"


def _schema(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def constraint(params, tool_mode: str, chat_template: str | None) -> StructuredOutput | None:
    """The grammar that enforces `required` or a named function; checks that `auto` has a format."""
    if tool_mode == "auto" and template_format(chat_template) is None:
        raise BadRequest('tool_choice "auto" needs the model\'s chat template to define a tool format, and this '
                         'model\'s template has none: use tool_choice "required" or name a function',
                         param="tool_choice")
    if tool_mode == "named":
        tool = next(t for t in params.tools if t.function.name == params.tool_choice.function.name)
        return StructuredOutput(json=_schema(tool))
    if tool_mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _schema(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in params.tools]
        return StructuredOutput(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
    return None


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse(text: str, params, tool_mode: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer; text that does not parse (cut by max_tokens) stays content."""
    try:
        if tool_mode == "named":
            return None, [_call(params.tool_choice.function.name, json.loads(text))]
        if tool_mode == "required":
            return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
        if tool_mode == "auto":
            calls = [json.loads(block) for block in HERMES.findall(text)]
            content = HERMES.sub("", text).strip() or None
            return content, [_call(c["name"], c.get("arguments", {})) for c in calls]
    except (ValueError, KeyError, TypeError):
        pass
    return text, []


def message_dicts(params, tool_format: str | None) -> list[dict]:
    """The chat's messages as the template gets them: tool calls and tool answers included."""
    out = []
    for m in params.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = [{"name": c.function.name, "parameters": _arguments(c.function.arguments)} for c in m.tool_calls]
            if tool_format is None:  # written as the model wrote them (`required`'s array)
                d["content"] = (d["content"] or "") + json.dumps(calls, ensure_ascii=False)
            else:
                d["tool_calls"] = [{"type": "function", "function": {"name": c["name"], "arguments": c["parameters"]}}
                                   for c in calls]
        if m.tool_call_id is not None and tool_format is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise BadRequest("messages: a tool call's function.arguments must be a JSON string",
                         param="messages") from None


def template_tools(params, tool_format: str | None) -> list[dict] | None:
    """The tools as a template with a tool format takes them (None: the template gets none)."""
    if tool_format is None or not params.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in params.tools]


def answer(params, tool_mode: str, text: str, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message's content and tool_calls for a finished answer, and its finish_reason
    ("tool_calls" when it called one)."""
    if tool_mode == "none":
        return {"content": text}, reason
    content, calls = parse(text, params, tool_mode)
    if not calls:
        return {"content": content}, reason
    return {"content": content, "tool_calls": calls}, "tool_calls" if reason == "stop" else reason
