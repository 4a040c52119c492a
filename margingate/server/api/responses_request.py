"""A Responses API body (`POST /v1/responses`) read and turned into the chat-completions body it means, so that
it runs the chat path unchanged (template, tools, grammar, policy):

- `input`: a string (one user message) or items: messages (role user / system / developer / assistant; content a
  string or `input_text` / `output_text` parts), `function_call` (a call the model made: an assistant message's
  tool call) and `function_call_output` (its result: a role-tool message); `instructions` is a system message
  first;
- `max_output_tokens` -> `max_completion_tokens`, `text.format` -> `response_format`, flat function `tools`
  -> chat tools, `tool_choice` {"type": "function", "name"} -> chat's named choice, `reasoning.effort` ->
  `reasoning_effort` (given to the template); `top_logprobs` (0..20) or `include` naming
  "message.output_text.logprobs" -> chat's `logprobs: true` + `top_logprobs`;
- the fields both APIs share (`temperature`, `top_p`, `seed`, `determinism`, ...) pass through as they are;
- nothing is stored (`store` is accepted, the answer says false), so `previous_response_id` and the other
  fields that need a stored or hosted state are a 400 naming them; other unknown fields are ignored and named
  in the answer's header, as on the other routes (`sdk_fields.py`).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..protocol import sdk_fields
from ..protocol.common import BadRequest, validation_message

# the fields a Responses body shares with a chat body: passed through unchanged
SHARED = frozenset({"model", "temperature", "top_p", "seed", "stream", "store", "metadata", "user", "service_tier",
                    "prompt_cache_key", "safety_identifier", "determinism", "deterministic", "speculative", "top_k",
                    "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                    "ignore_eos", "stop", "min_tokens", "chat_template_kwargs"})

UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((None,), "previous_response_id is not supported: this server stores no responses "
                                      "(store is always false); send the whole conversation in input"),
    "conversation": ((None,), "conversation is not supported: this server stores no conversations; send the "
                              "whole conversation in input"),
    "background": ((None, False), "background responses are not supported"),
    "prompt": ((None,), "prompt (a stored prompt template) is not supported: send instructions and input"),
    "truncation": ((None, "disabled"), "truncation auto is not supported: a prompt too long is refused"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported: use parallel_tool_calls"),
}

# the `include` value that asks for the output text's logprobs
LOGPROBS = "message.output_text.logprobs"

# a chat field's name in a refusal -> the Responses field it came from
RENAMED = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
           ("reasoning_effort", "reasoning.effort"))


class _Item(BaseModel):
    # keys the SDKs send back with an item (id, status, annotations, logprobs, ...) change nothing here
    model_config = ConfigDict(extra="ignore", strict=True)


class TextContent(_Item):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Item):
    """A reasoning item the model wrote, sent back: accepted and left out of the prompt (the templates of
    reasoning models drop an earlier turn's reasoning too)."""
    type: Literal["reasoning"]


ITEMS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                 "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class FunctionTool(BaseModel):
    """Responses' flat function tool."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: Literal[False] | None = None
    allowed_callers: list[Literal["direct"]] | None = None
    output_schema: dict[str, Any] | None = None   # describes the tool's result to the model; not read here

    def chat(self) -> dict:
        return {"type": "function", "function": self.model_dump(include={"name", "description", "parameters",
                                                                          "strict"}, exclude_none=True)}


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": self.model_dump(by_alias=True, exclude={"type"},
                                                                      exclude_none=True)}


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # a hint to OpenAI's models; changes nothing here


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)   # summary, generate_summary: no reasoning items here
    effort: str | None = None


class ResponsesRequest(BaseModel):
    """The Responses API's own fields; the shared ones (SHARED) stay in `model_extra` and pass through."""
    model_config = ConfigDict(extra="allow", strict=True)

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    include: list[str] | None = None   # extra data in the answer: the text's logprobs (LOGPROBS); others ignored
    top_logprobs: int | None = None

    @property
    def logprobs(self) -> bool:
        """The output text carries its tokens' logprobs: `include` names them, or top_logprobs asks for some."""
        return LOGPROBS in (self.include or []) or bool(self.top_logprobs)

    def ignored_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - SHARED)

    def chat_body(self) -> dict:
        """The chat-completions body this request means."""
        body: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if k in SHARED}
        body["messages"] = chat_messages(self.instructions, self.input)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        if self.tools:
            body["tools"] = [t.chat() for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        return body


def chat_messages(instructions: str | None, given: str | list[dict]) -> list[dict]:
    """The chat messages: instructions as a system message, then each item (consecutive function calls join
    the assistant message before them, as a chat message holds its text and its calls)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not given:
        raise BadRequest("input: needs at least one item", param="input")
    for i, raw in enumerate(given):
        item = read_item(i, raw)
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
    return out


def read_item(i: int, raw: Any) -> _Item:
    """Input item i, validated; a 400 names its field (`input.3.call_id`)."""
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    if kind not in ITEMS:
        raise BadRequest(f"input.{i}.type: {kind!r} is not supported (message, function_call, "
                         f"function_call_output, reasoning are)", param=f"input.{i}.type")
    try:
        return ITEMS[kind].model_validate(raw)
    except ValidationError as exc:
        message, param = validation_message(exc)
        where = f"input.{i}" + (f".{param}" if param else "")
        raise BadRequest(f"input.{i}: {message}", param=where) from None


def read_request(body: dict) -> ResponsesRequest:
    """The body, validated; every refusal a BadRequest naming the Responses field."""
    if not isinstance(body.get("input"), (str, list)):
        got = "nothing" if body.get("input") is None else type(body["input"]).__name__
        raise BadRequest(f"input: must be a string or a list of items, got {got}", param="input")
    try:
        sdk_fields.refuse_unsupported(body, UNSUPPORTED)
        params = ResponsesRequest.model_validate(body)
        unknown = {k: v for k, v in (params.model_extra or {}).items() if k not in SHARED}
        sdk_fields.check_unknown(unknown, set(ResponsesRequest.model_fields) | SHARED)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise BadRequest(message, param=param) from None
    except ValueError as exc:  # "field: why"
        raise BadRequest(str(exc), param=str(exc).split(":", 1)[0]) from None
    if params.max_output_tokens is not None and params.max_output_tokens < 1:
        raise BadRequest("max_output_tokens: must be >= 1", param="max_output_tokens")
    return params


def responses_param(param: str | None) -> str | None:
    """A chat field named in a refusal, as the Responses field it came from."""
    if param is None:
        return None
    for chat, responses in RENAMED:
        if param == chat or param.startswith(chat + "."):
            return responses + param[len(chat):] if chat != "messages" else "input"
    return param.replace(".function.", ".")  # tools.0.function.parameters, tool_choice.function.name

