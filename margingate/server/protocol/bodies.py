"""The two generation bodies, validated (pydantic) over `protocol.py`'s common fields: completions'
(`prompt`: a string, token ids, or a list of up to MAX_PROMPTS of those; `echo`, `logprobs: k`, `best_of`)
and chat's (`messages`, `tools`, `tool_choice`, logprobs as `logprobs` + `top_logprobs`, the chat
template's options). What each field means and what is refused: `protocol.py`'s docstring."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import sdk_fields
from .common import MAX_PROMPTS, CommonBody
from .formats import NamedToolChoice, Tool, ToolCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra keys clients send along (name, refusal: null, ...) are ignored
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's calls, sent back
    tool_call_id: str | None = None            # a tool's answer: to which call

    @model_validator(mode="after")
    def _content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: a message needs content (an assistant's may give tool_calls instead)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class CompletionRequest(CommonBody):
    prompt: Any
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        """A string or a list of token ids, or a list of those: always a list of prompts here."""
        if v is None:
            raise ValueError("a prompt is required")
        many = isinstance(v, list) and bool(v) and all(isinstance(x, (str, list)) for x in v)
        prompts = list(v) if many else [v]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request (got {len(prompts)})")
        return [_one_prompt(p) for p in prompts]

    @model_validator(mode="after")
    def _combinations(self):
        if self.best_of is not None and self.best_of != self.choices_per_prompt:
            raise ValueError("best_of: only best_of = n is supported (every sample is returned)")
        if self.echo and self.choices_per_prompt > 1:
            raise ValueError("echo: echo with n > 1 is not supported (echo scores one sequence per prompt)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only meaningful with echo (scoring the prompt)")
        return self

    def sampling_options(self) -> dict:
        k = self.logprobs
        return {**super().sampling_options(), "logprobs": k,
                "prompt_logprobs": (k or 0) if self.echo else None}


def _one_prompt(v):
    if isinstance(v, str):
        if not v:
            raise ValueError("the prompt is empty")
        return v
    if isinstance(v, list):
        if not v:
            raise ValueError("the prompt is empty")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return list(v)
    raise ValueError(f"a prompt must be a string or a list of integer token ids, got {type(v).__name__}")


class ChatCompletionRequest(CommonBody):
    UNSUPPORTED: ClassVar[dict] = {**sdk_fields.UNSUPPORTED, **sdk_fields.CHAT_UNSUPPORTED}
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the chat template's: passed to it (a template that does not read one is unchanged by it)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens == 0:
            raise ValueError("max_tokens: must be >= 1 for chat")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        sdk_fields.check_template_kwargs(self.chat_template_kwargs)
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ValueError("continue_final_message: needs add_generation_prompt false and an assistant message "
                             "last")
        return self

    def template_options(self) -> dict:
        """What the chat template is given besides the messages and tools."""
        extra = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**(self.chat_template_kwargs or {}), **extra, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def sampling_options(self) -> dict:
        return {**super().sampling_options(), "logprobs": (self.top_logprobs or 0) if self.logprobs else None}
