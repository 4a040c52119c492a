"""A body's output constraint (`formats.py`'s fields) as the engine's `StructuredOutput`, compiled at
the door: a bad schema, regex or grammar is a 400 naming the field it came in, and never reaches
the engine thread."""
from __future__ import annotations

from ...options.structured import StructuredError, StructuredOutput
from ..protocol.common import BadRequest

GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "grammar"))


def _given(params) -> list[tuple[str, dict]]:
    """(field, StructuredOutput keywords) of every constraint the body gives."""
    given = []
    rf = params.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        given.append(("response_format.json_schema.schema", {"json": rf.json_schema.schema_}))
    given += [(name, {key: getattr(params, name)}) for name, key in GUIDED if getattr(params, name) is not None]
    if params.structured_outputs is not None:
        options = params.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        given.append(("structured_outputs", {k: v for k, v in options.items() if v is not False}))
    return given


def constraint(params) -> tuple[StructuredOutput | None, str | None]:
    """The body's one constraint and the field it came in (None, None: unconstrained)."""
    given = _given(params)
    if len(given) > 1:
        raise BadRequest(f"give one output constraint, not both {given[0][0]} and {given[1][0]}", param=given[1][0])
    if not given:
        return None, None
    field, options = given[0]
    try:
        return StructuredOutput(**options), field
    except StructuredError as exc:
        raise BadRequest(str(exc), param=f"structured_outputs.{exc.option}" if field == "structured_outputs"
                         else field) from None


def compiled(grammars, params) -> StructuredOutput | None:
    """`constraint`, compiled against the model's tokenizer (run it off the event loop: a large
    schema takes a while)."""
    out, field = constraint(params)
    if out is not None:
        try:
            grammars.compile(out)
        except StructuredError as exc:
            raise BadRequest(str(exc), param=field) from None
    return out
