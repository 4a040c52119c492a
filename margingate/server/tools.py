"""Tool calls on chat completions: `tools` and `tool_choice` in, OpenAI's `tool_calls` out.

Calls are `<tool_call>` blocks (`tool_format.py`) on every model. A template with a tool format of its
own (Qwen, Hermes, SmolLM3: the same blocks) gets the tools and renders the calls sent back itself; a
template without one gets our system turn that lists the tools and teaches the blocks, and the calls
sent back as the blocks the model wrote, so an agent loop gives the model back its own tokens.

- `none` (and no tools): plain text.
- `auto` (the default with tools): text or calls. Without a template format the grammar holds an answer
  that opens a call to the format from its first character; with one the model's own format is trusted
  and only parsed.
- `required` and a named function: calls only, enforced by the grammar, so they always parse.
- `parallel_tool_calls: false` allows one call; otherwise at most one per tool offered, so a model that
  would repeat its call stops instead of running to max_tokens.

A block that does not parse, names a function that is not offered or exceeds the calls allowed is
never made a call and never dropped: it stays in `content` after a `[margingate: not a tool call ...]`
marker.

Small models often write the call in another shape than their template's blocks: a JSON object with the
call's `name` and `arguments` in a Markdown fence, or as the whole answer (Qwen2.5-Coder does both).
Such an object that names an offered tool and holds nothing but `name` and `arguments` is a call too, and
the text around it stays content; any other JSON stays text, unmarked (it may be code the user asked for).

Streamed, a call goes out as it is written: its name, then its arguments in fragments (`call_parser.py`),
bitwise the arguments of the whole answer.
"""
from __future__ import annotations

import json
from typing import Any

from ..options.structured import StructuredOutput
from . import harmony, tool_format
from .answer import Answer, PlainParser
from .call_parser import CallParser
from .formats import NamedToolChoice
from .protocol import BadRequest


def template_format(chat_template: str | None) -> str | None:
    """The tool format the model's chat template defines: "hermes", "harmony" (gpt-oss: harmony.py), or None
    (ours is used)."""
    if harmony.is_harmony(chat_template):
        return "harmony"
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


def offered(params, tool_mode: str) -> list:
    """The tools a call may name: the named one, or all."""
    if tool_mode == "named":
        return [t for t in params.tools if t.function.name == params.tool_choice.function.name]
    return list(params.tools or []) if tool_mode != "none" else []


def max_calls(params, tool_mode: str) -> int:
    return 1 if tool_mode == "named" or params.parallel_tool_calls is False else len(params.tools)


def constraint(params, tool_mode: str, tool_format_name: str | None, grammars=None) -> StructuredOutput | None:
    """The grammar that holds the answer to the calls' format (None: unconstrained); `grammars` (the model's
    `engine.structured.Grammars`) says which markers its tokenizer has as one special token."""
    if tool_mode == "none" or (tool_mode == "auto" and tool_format_name is not None):
        return None
    if tool_format_name == "harmony":
        marks = (harmony.CHANNEL, harmony.CONSTRAIN, harmony.MESSAGE)
        special = frozenset(m for m in marks if grammars is not None and grammars.is_special(m))
        return StructuredOutput(grammar=harmony.grammar(offered(params, tool_mode), special))
    marks = (tool_format.OPEN, tool_format.CLOSE)
    tokens = frozenset(m for m in marks if grammars is not None and grammars.is_special(m))
    grammar = tool_format.grammar(offered(params, tool_mode), max_calls(params, tool_mode), text=tool_mode == "auto",
                                  tokens=tokens)
    return StructuredOutput(grammar=grammar)


def parser(params, tool_mode: str, whole: bool) -> CallParser | PlainParser:
    """The answer's parser: its text as content (no tools), or content and calls (`call_parser.py`);
    `whole`: the answer is read at once, not streamed."""
    if tool_mode == "none":
        return PlainParser()
    return CallParser({t.function.name for t in offered(params, tool_mode)}, max_calls(params, tool_mode), whole)


def parse(text: str, params, tool_mode: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer. A block that is no call stays in content after a marker; an
    answer may state its calls as JSON objects (module docstring)."""
    answer, read = Answer(stripped=True), parser(params, tool_mode, whole=True)
    answer.take(read.feed(text) + read.finish())
    return answer.message()["content"], answer.calls


# --- the prompt -------------------------------------------------------------------------------

def message_dicts(params, tool_format_name: str | None, tool_mode: str) -> list[dict]:
    """The chat's messages as the template gets them: tool calls and tool answers included, and (a
    template without a tool format) our system turn offering the tools."""
    out = []
    for m in params.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = [(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls]
            if tool_format_name is None:  # as the model wrote them
                d["content"] = "\n".join([*([d["content"]] if d["content"] else []),
                                          *(tool_format.block(n, a) for n, a in calls)])
            else:
                d["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
        if m.tool_call_id is not None and tool_format_name is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    if tool_format_name is None and tool_mode != "none":
        offer = tool_format.system_prompt(offered(params, tool_mode), max_calls(params, tool_mode))
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{offer}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise BadRequest("messages: a tool call's function.arguments must be a JSON string",
                         param="messages") from None


def template_tools(params, tool_format_name: str | None) -> list[dict] | None:
    """The tools as a template with a tool format takes them (None: the template gets none)."""
    if tool_format_name is None or not params.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in params.tools]
