"""`StructuredOutput`: what a request's output must match (plain data, validated once); the mask that
holds it there is `engine/structured.py`'s."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from ..errors import OptionError

MAX_CHOICES = 256
JSON_OBJECT = '{"type": "object"}'


class StructuredError(OptionError):
    """A bad constraint; `option` names the `StructuredOutput` field."""


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json` (a JSON schema, a dict or its text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings, whole), `grammar` (Lark in llguidance's dialect, or GBNF)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise StructuredError(given[1] if given else "json", "give exactly one of json, json_object, regex, "
                                                                 f"choice, grammar (got {', '.join(given) or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise StructuredError("json", f"json must be a JSON schema (an object), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredError(name, f"{name} must be a non-empty string")
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or len(choice) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choice):
                raise StructuredError("choice", f"choice must be 1 to {MAX_CHOICES} non-empty strings")
            object.__setattr__(self, "choice", choice)

    @property
    def option(self) -> str:
        """The field that holds the constraint."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def source(self) -> tuple[str, str]:
        """(llguidance's format name, text) of the constraint."""
        if self.json is not None:
            return "json_schema", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.json_object:
            return "json_schema", JSON_OBJECT
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar
