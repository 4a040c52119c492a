"""The request fields that constrain the output, as OpenAI and vLLM spell them (validated shapes
only; `constraints.py` turns them into the engine's `StructuredOutput`):

- `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}} (OpenAI);
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older extras) and
  `structured_outputs`: {json | json_object | regex | choice | grammar} (vLLM's newer one);
- `logprobs_mode`: "raw" | "processed";
- chat's `tools`, `tool_choice` and the tool calls messages carry back (`tools.py`).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("json_schema: a response_format of type json_schema needs json_schema.schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` block: one of its fields."""
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class ConstraintFields(BaseModel):
    """The fields a completions or chat body may constrain its output with (mixed into both)."""
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    logprobs_mode: Literal["raw", "processed"] | None = None
# --- tools ------------------------------------------------------------------------------

class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an assistant message sent back (the `index` streamed deltas carry is ignored)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
