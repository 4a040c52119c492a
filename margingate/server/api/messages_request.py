"""An Anthropic Messages body (`POST /v1/messages`) read and turned into the chat-completions body it means, so
that it runs the chat path unchanged (template, tools, grammar, reasoning, policy):

- `system` (a string or text blocks) is a system message first; `messages` with role user / assistant and
  content a string or blocks: `text`, an assistant's `tool_use` (a tool call: its `input` is the call's
  arguments) and `thinking` (left out of the prompt, as the templates of reasoning models leave an earlier
  turn's reasoning out), a user's `tool_result` (a role-tool message answering its `tool_use_id`);
- `max_tokens` (required, as Anthropic's API has it) -> `max_completion_tokens`, `stop_sequences` -> `stop`,
  `tools` ({name, description, input_schema}) -> chat's function tools, `tool_choice` auto / any / tool / none
  -> auto / required / named / none (`disable_parallel_tool_use` -> `parallel_tool_calls: false`),
  `thinking` {type: enabled | disabled} -> `chat_template_kwargs.enable_thinking`;
- `temperature`, `top_p`, `top_k`, `stream` and our extensions (`determinism`, `seed`, ...) pass through;
  `metadata` is accepted; images, documents and Anthropic's server tools are a 400 naming the field.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..protocol.common import BadRequest, validation_message

# the fields a Messages body shares with a chat body: passed through unchanged
SHARED = frozenset({"temperature", "top_p", "top_k", "stream", "seed", "determinism", "deterministic", "speculative",
                    "min_p", "repetition_penalty", "ignore_eos", "min_tokens"})
UNION_MEMBER = re.compile(r"\.(?:str|list\[|dict\[|union\[|function-)")
# a chat field's name in a refusal -> the Messages field it came from
RENAMED = (("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"), ("tool_choice.function", "tool_choice"),
           ("chat_template_kwargs", "thinking"))


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)   # cache_control, citations: change nothing here


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["custom"] | None = None   # Anthropic's server tools (web_search_..., bash_...) are refused
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    def chat(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)   # budget_tokens: the model decides here
    type: Literal["enabled", "disabled"]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int = Field(ge=1, le=1_000_000)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None

    def ignored_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - SHARED)

    def chat_body(self) -> dict:
        """The chat-completions body this request means."""
        body: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if k in SHARED}
        body.update(model=self.model, max_completion_tokens=self.max_tokens, messages=chat_messages(self))
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.tools:
            body["tools"] = [t.chat() for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        return body


def chat_messages(request: MessagesRequest) -> list[dict]:
    system = request.system
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else
                    "".join(b.text for b in system)})
    for m in request.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                for b in blocks if isinstance(b, ToolResultBlock)]
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def read_request(body: dict) -> MessagesRequest:
    """The body, validated; every refusal a BadRequest naming the Messages field."""
    try:
        params = MessagesRequest.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc)
        # a field that takes a string or blocks: pydantic names the union's member tried ("content.str")
        raise BadRequest(message, param=param and UNION_MEMBER.split(param)[0]) from None
    if params.tool_choice is not None and (params.tool_choice.type == "tool") != (params.tool_choice.name is not None):
        raise BadRequest("tool_choice: a name goes with type tool, and only there", param="tool_choice.name")
    return params


def messages_param(param: str | None) -> str | None:
    """A chat field named in a refusal, as the Messages field it came from."""
    if param is None:
        return None
    for chat, messages in RENAMED:
        if param == chat or param.startswith(chat + "."):
            return messages + param[len(chat):]
    return param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
