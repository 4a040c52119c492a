"""Our tool-call format, for every model: Hermes `<tool_call>` blocks (the format of Qwen, Hermes and
SmolLM3's templates), the system turn that teaches it to a model whose template has no tool format, and
the llguidance grammars that hold a call to it.

A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, its JSON compact and its arguments
of the function's schema, closed: an object schema that does not say `additionalProperties` gets
false, so a forced call ends after the properties it lists instead of inventing keys (JSON Schema's
default is open). A schema that says otherwise keeps its word.
"""
from __future__ import annotations

import json

OPEN, CLOSE = "<tool_call>", "</tool_call>"

# Subschema keywords: a map of schemas, a schema, or a list of schemas.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")


def closed(schema):
    """`schema` with `additionalProperties: false` on every object schema that lists properties and says
    nothing about others (a copy)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in (*_ONE, *_MANY):
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = closed(value)
        elif isinstance(value, list):  # anyOf and the like, or items' older list form
            out[key] = [closed(s) for s in value]
    return out


def parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def call_schema(tools) -> dict:
    """One call of any of `tools`: {"name": its name, "arguments": its closed parameters}, compact."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                               "arguments": closed(parameters(t))},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    # one spelling of a call (json.dumps'), and no run of whitespace a small model can loop in
    return {"anyOf": calls, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def grammar(tools, max_calls: int, text: bool, tokens: frozenset[str] = frozenset()) -> str:
    """Lark for 1..max_calls calls of `tools`, one per line; with `text`, plain text instead is allowed
    too, but an answer that opens a call is held to the format from its first character. `tokens`: the
    markers the tokenizer has as one special token (Qwen's), named as that token rather than spelled."""
    more = f' ("\\n" call){{0,{max_calls - 1}}}' if max_calls > 1 else ""
    marks = [mark if mark in tokens else json.dumps(mark) for mark in (OPEN, CLOSE)]
    lines = [f"start: {'TEXT | ' if text else ''}calls",
             f"calls: call{more}",
             f'call: {marks[0]} "\\n" body "\\n" {marks[1]}',
             f"body: %json {json.dumps(call_schema(tools))}"]
    if text:  # anything that does not open with a call (after whitespace)
        lines.append(r"TEXT: /(?s:.+)/ & ~/(?s:[ \t\r\n]*<tool_call>.*)/")
    return "\n".join(lines) + "\n"


def block(name: str, arguments) -> str:
    """One call as the format writes it (an assistant's calls sent back, in the model's own tokens)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def system_prompt(tools, max_calls: int) -> str:
    """The system turn that offers `tools` to a model whose chat template has no tool format."""
    listed = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                   "parameters": parameters(t)}, ensure_ascii=False) for t in tools)
    how_many = "one call" if max_calls == 1 else f"up to {max_calls} calls, one per block"
    return (f"You can call these functions:\n{listed}\n"
            f"To call a function, answer with nothing but {how_many}, each written as\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<the arguments as JSON>}}}}\n{CLOSE}\n'
            "Otherwise answer in plain text.")
