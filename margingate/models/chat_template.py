"""A chat template rendered as transformers' `apply_chat_template(..., tokenize=False)` renders it, without
importing transformers (about 2 s at every start).

The same Jinja environment (a sandbox with trim_blocks, lstrip_blocks and loop controls; `tojson` without
HTML escaping; `raise_exception`, `strftime_now`, a restricted `dict` and `namespace`; the `{% generation %}`
tag, which only marks text), the same inputs (messages as plain dicts without their None values, the
reasoning under its three names, tools as JSON schemas, the tokenizer's special tokens beside the caller's
keywords) and the same `continue_final_message` cut. `tests/test_tokenizer_backend.py` renders chats, tools and
keywords through both and compares the text (transformers 5.24). What transformers does that is not here:
tools given as Python functions (turned into schemas) and the assistant-token mask.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a message's reasoning
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


HARMONY_MARKS = ("<|channel|>", "<|message|>")  # gpt-oss's format: its marks are special tokens


def is_harmony(chat_template: str | dict | None) -> bool:
    """Does the model's chat template write harmony (gpt-oss)?"""
    return isinstance(chat_template, str) and all(m in chat_template for m in HARMONY_MARKS)


def render(template: str, messages: list, *, tools: list[dict] | None = None, documents: list[dict] | None = None,
           add_generation_prompt: bool = False, continue_final_message: bool | str = False,
           special_tokens: Mapping[str, Any] | None = None, **kwargs) -> str:
    """The text of one conversation: `special_tokens` (bos_token, eos_token, ...) are what the template sees
    unless `kwargs` sets the same name."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError("Tools should be JSON schemas (dicts)")
    chat = _alias_reasoning([_plain(m) for m in _without_none(messages)])
    final = None
    if continue_final_message:
        final = _mark_final(chat, template, continue_final_message)
    text = _compiled(template).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                      add_generation_prompt=add_generation_prompt,
                                      **_plain({**(special_tokens or {}), **kwargs}))
    return text if final is None else _cut_at_tag(text, final)


def _without_none(messages: list) -> list[dict]:
    """Each message as a dict without the keys whose value is None (transformers' `_normalize_chat_messages`)."""
    out = []
    for m in messages:
        m = _dicts(m)
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """Only JSON types reach the sandbox; anything else becomes an inert "<TypeName>" (transformers' rule)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, numpy scalars) lose their methods
        if isinstance(value, kind):
            return getattr(kind, f"__{kind.__name__}__")(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy":
        import numpy as np

        if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
            return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _mark_final(chat: list[dict], template: str, field: bool | str) -> str:
    """Tag the end of the last message's text (the render is cut there); returns that text."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field] if field not in REASONING_FIELDS else [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):
        block = next((b for b in reversed(final) if "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message is set but we could not find any text to continue in the "
                             "final message!")
        final, block["text"] = block["text"], block["text"] + CONTINUE_TAG
        return final
    for f in fields:
        chat[-1][f] = chat[-1][f] + CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


@functools.lru_cache
def _compiled(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: marks the assistant's text for a mask; renders it as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_as_is"), [], [], body).set_lineno(lineno)

        def _as_is(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=_namespace())
    return env.from_string(template)


class _TemplateDict:
    """`dict(...)` inside a template, without the type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.cache
def _namespace():
    """jinja2's namespace, refusing underscore names (a way out of the sandbox), as transformers' is."""
    import jinja2

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace
