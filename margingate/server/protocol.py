"""Request bodies of the OpenAI-compatible API, validated (pydantic), and the response shapes.

What is supported, and what is refused with a 400 naming the field:
- `n` up to MAX_N choices per prompt; `best_of` only equal to `n`; `suffix` is refused;
- `prompt` (completions): a string, a list of token ids, or a list of up to MAX_PROMPTS of
  those (choice i*n + j is sample j of prompt i);
- sampling (`top_p`, `top_k`, `min_p`, `presence_penalty`, `frequency_penalty`,
  `repetition_penalty`, `logit_bias`) and logprobs (completions: `logprobs: k`, `echo`;
  chat: `logprobs: true` + `top_logprobs: k`): the values are checked by `SamplingParams`,
  the one validator, and a bad one is a 400 naming this protocol's field;
- `messages` (chat): roles system / user / assistant / tool, content a string or a list of
  {"type": "text", "text": ...} parts, an assistant's `tool_calls` sent back; `tools` and
  `tool_choice` (`tools.py`);
- `temperature` defaults to 0 (greedy), unlike OpenAI's 1: the server's point is reproducible
  output; values below 1e-5 are greedy (as vLLM does); at most 2;
- `stop`: a string or up to 4 strings (the text is cut before the stop string; token ids, logprobs
  and usage end with the token that completes it: `engine/detokenize.py`);
- extensions: `deterministic` (bool), `determinism` {policy, tau, repair, strict,
  verifier_precision, defer, window, group}, `speculative` {method, num_tokens, ngram_max,
  ngram_min}, `ignore_eos` (bool), `top_k`, `min_p`, `repetition_penalty`;
- output constraints (`formats.py`): `response_format` json_object / json_schema, vLLM's `guided_*`
  and `structured_outputs`, and `logprobs_mode` (raw | processed);
- fields SDKs send: accepted where they change nothing here, honoured where they mean something
  (`min_tokens`, chat's `chat_template_kwargs`, `reasoning_effort`, `add_generation_prompt`,
  `continue_final_message`), a 400 naming them where they would change the output and are not
  implemented; unknown fields are ignored and named in a response header, unless they look like a
  misspelling of ours (`sdk_fields.py`).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import sdk_fields
from .formats import ConstraintFields, NamedToolChoice, Tool, ToolCall

MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_N = 16          # choices per prompt
MAX_PROMPTS = 64    # prompts per completions request
GREEDY_BELOW = 1e-5


class BadRequest(ValueError):
    """A request the server refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON: no NaN / Infinity, UTF-8, bounded nesting; raises BadRequest naming the problem."""
    if not raw.strip():
        raise BadRequest("the request body is empty: expected a JSON object", code="malformed_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8: {exc}", code="malformed_json") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}", code="malformed_json") from None


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One readable line per problem, and the first offending field."""
    parts, first = [], None
    for err in exc.errors(include_url=False):
        loc = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("function-"))
        if first is None and loc:
            first = loc
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        named = re.match(r"(\w+): ", msg) if not loc else None  # a check across fields names its field
        if named and first is None:
            first = named.group(1)
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (not supported by this server)"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request", first


# --- pieces --------------------------------------------------------------------------

class DeterminismOptions(BaseModel):
    """The `determinism` block: which policy protects this request, and how. Unset fields take
    the server's default policy and `PolicySpec`'s defaults; `PolicySpec` validates the values
    (its field names are these), so a bound is written once for HTTP, the CLI and the API."""
    model_config = ConfigDict(extra="forbid", strict=True)

    policy: str | None = None
    tau: float | None = None   # Infinity: verify every step
    repair: str | None = None
    strict: bool | None = None
    verifier_precision: str | None = None
    defer: int | None = None
    window: int | None = None
    group: int | None = None

    def spec_options(self) -> dict:
        """The options given, as `PolicySpec` keywords."""
        return self.model_dump(exclude_none=True, exclude={"policy"})


class SpeculativeOptions(BaseModel):
    """The `speculative` block; `SpeculativeConfig` validates the values and owns the defaults (its field
    names are these; an absent one is left out)."""
    model_config = ConfigDict(extra="forbid", strict=True)

    method: str | None = None
    num_tokens: int | None = None
    ngram_max: int | None = None
    ngram_min: int | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


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


# --- bodies ----------------------------------------------------------------------------

class _Common(ConstraintFields):
    # unknown fields are kept aside (`ignored_fields`) to be named in the answer, not refused (sdk_fields.py)
    model_config = ConfigDict(extra="allow", strict=True)
    UNSUPPORTED: ClassVar[dict] = sdk_fields.UNSUPPORTED

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=1_000_000)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)  # the newer name, either endpoint
    temperature: float | None = Field(default=None, allow_inf_nan=False)
    top_p: float | None = Field(default=None, allow_inf_nan=False)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # What SDKs send that changes no token here (this server stores nothing, has one tier, caches prompts by
    # their tokens): accepted so that clients run unchanged, as vLLM does (its #10463).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's: the stop tokens (EOS) cannot be chosen before this many tokens (engine/sampling.py)
    min_tokens: int = Field(default=0, ge=0, le=1_000_000)
    # extensions
    top_k: int | None = None
    min_p: float | None = Field(default=None, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, allow_inf_nan=False)
    deterministic: bool | None = None
    determinism: DeterminismOptions | None = None
    speculative: SpeculativeOptions | None = None
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, body):
        sdk_fields.refuse_unsupported(body, cls.UNSUPPORTED)
        return body

    @model_validator(mode="after")
    def _one_limit(self):
        sdk_fields.check_unknown(self.model_extra or {}, type(self).model_fields)
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; give one")
        limit = self.tokens_limit()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({limit})")
        return self

    def ignored_fields(self) -> list[str]:
        """The unknown fields the body gave: ignored, and named in the answer's header."""
        return sorted(self.model_extra or {})

    def tokens_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is not None and not all(k.strip().isdigit() for k in v):
            raise ValueError("logit_bias keys must be token ids (non-negative integers, as strings)")
        return v

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    def sampling_options(self) -> dict:
        """The `SamplingParams` keywords this body sets (logprobs: the subclass adds them)."""
        opts = {"temperature": self.greedy_temperature, "seed": self.seed, "stop": tuple(self.stop_strings),
                "logprobs_mode": self.logprobs_mode, "min_tokens": self.min_tokens,
                "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()}}
        for name, value in (("top_p", self.top_p), ("top_k", self.top_k), ("min_p", self.min_p),
                            ("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty),
                            ("repetition_penalty", self.repetition_penalty)):
            if value is not None:
                opts[name] = value
        return opts

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings (got {len(stops)})")
        for s in stops:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_LEN:
                raise ValueError(f"stop strings must be at most {MAX_STOP_LEN} characters")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy_temperature(self) -> float:
        t = self.temperature or 0.0
        return 0.0 if 0 <= t < GREEDY_BELOW else t

    @property
    def streaming(self) -> bool:
        return bool(self.stream)


class CompletionRequest(_Common):
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


class ChatCompletionRequest(_Common):
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


# --- responses -------------------------------------------------------------------------

def finite(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become None (JSON has no NaN / Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


OPENAI_FINISH = {"stop": "stop", "length": "length", "context": "length", "aborted": "abort"}
