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

All of it is read from the body once, into the request's `ToolPlan` (`plan`: the mode, the tools offered, the
calls allowed, the format, the grammar), which the job carries: the prompt, the constraint and each choice's
parser read the plan.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...options.structured import StructuredOutput
from ..parsers import harmony, tool_format
from ..parsers.answer import Answer, PlainParser
from ..parsers.call_parser import CallParser
from ..protocol.common import BadRequest
from ..protocol.formats import NamedToolChoice


def template_format(chat_template: str | None, writes_harmony: bool = False) -> str | None:
    """The tool format the model's chat template defines: "hermes", "harmony" (gpt-oss: harmony.py; as the
    tokenizer found it, `Tokenizer.harmony`), or None (ours is used)."""
    if writes_harmony:
        return "harmony"
    return "hermes" if chat_template and "tools" in chat_template and "<tool_call>" in chat_template else None


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean, read once from its body (`plan`) and carried on its job: the prompt, the
    output constraint and every choice's parser read it, never the body again."""
    mode: str = "none"                # "none", "auto", "required" or "named" (a named function)
    tools: tuple = ()                 # every tool the body lists (a template with a tool format is given all)
    offered: tuple = ()               # the tools a call may name: the named one, or all
    max_calls: int = 0                # calls one answer may make
    template_format: str | None = None   # the chat template's own tool format ("hermes"), or None: ours
    constraint: StructuredOutput | None = None  # the grammar that holds the answer to the calls; None: free

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.offered}

    def parser(self, whole: bool) -> CallParser | PlainParser | harmony.HarmonyParser:
        """A choice's parser: its text as content (no tools), or content and calls (`call_parser.py`); a harmony
        template's (gpt-oss) reads channels, not marks in the text (`harmony.py`); `whole`: the answer is read
        at once, not streamed."""
        if self.template_format == "harmony":
            return harmony.HarmonyParser(self.names, self.max_calls if self.names else 0)
        return PlainParser() if self.mode == "none" else CallParser(self.names, self.max_calls, whole)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer. A block that is no call stays in content after a marker; an
        answer may state its calls as JSON objects (module docstring)."""
        answer, read = Answer(stripped=True), self.parser(whole=True)
        answer.take(read.feed(text) + read.finish())
        return answer.message()["content"], answer.calls


NO_TOOLS = ToolPlan()


def plan(params, template_format_name: str | None, grammars=None) -> ToolPlan:
    """The body's tool plan; refuses a `tool_choice` without tools, repeated names, a name not offered.
    `grammars` (the model's `engine.structured.Grammars`) says which markers its tokenizer has as one special
    token."""
    tool_mode = mode(params)
    if tool_mode == "none":
        return ToolPlan(template_format=template_format_name, tools=tuple(params.tools or ()))
    tools = tuple(params.tools)
    named = params.tool_choice.function.name if tool_mode == "named" else None
    offered = tuple(t for t in tools if t.function.name == named) if named else tools
    max_calls = 1 if tool_mode == "named" or params.parallel_tool_calls is False else len(tools)
    return ToolPlan(tool_mode, tools, offered, max_calls, template_format_name,
                    constraint(tool_mode, offered, max_calls, template_format_name, grammars))


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


def constraint(tool_mode: str, offered: tuple, max_calls: int, template_format_name: str | None,
               grammars=None) -> StructuredOutput | None:
    """The grammar that holds the answer to the calls' format (None: unconstrained): forced calls, or `auto`
    where the template has no tool format of its own (an answer that opens a call is held to ours)."""
    if tool_mode == "none" or (tool_mode == "auto" and template_format_name is not None):
        return None
    if template_format_name == "harmony":
        marks = (harmony.CHANNEL, harmony.CONSTRAIN, harmony.MESSAGE)
        special = frozenset(m for m in marks if grammars is not None and grammars.is_special(m))
        return StructuredOutput(grammar=harmony.grammar(offered, special))
    marks = (tool_format.OPEN, tool_format.CLOSE)
    tokens = frozenset(m for m in marks if grammars is not None and grammars.is_special(m))
    return StructuredOutput(grammar=tool_format.grammar(offered, max_calls, text=tool_mode == "auto", tokens=tokens))


# --- the prompt -------------------------------------------------------------------------------

def message_dicts(params, plan: ToolPlan) -> list[dict]:
    """The chat's messages as the template gets them: tool calls and tool answers included, and (a
    template without a tool format) our system turn offering the tools."""
    tool_format_name, out = plan.template_format, []
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
    if tool_format_name is None and plan.mode != "none":
        offer = tool_format.system_prompt(plan.offered, plan.max_calls)
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


def template_tools(plan: ToolPlan) -> list[dict] | None:
    """The tools as a template with a tool format takes them (None: the template gets none)."""
    if plan.template_format is None or not plan.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in plan.tools]
