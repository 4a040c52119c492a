"""Request bodies of the OpenAI-compatible API, validated (pydantic), and the response shapes.

What is supported, and what is refused with a 400 naming the field:
- one choice per request: `n` must be 1; `best_of` must be 1; `echo`, `suffix`,
  `logprobs`, `logit_bias`, penalties and `top_p` other than their neutral values are refused;
- `prompt` (completions): a string, a list of token ids, or a list holding exactly one of
  those (several prompts per request are refused: send one request each);
- `messages` (chat): roles system / user / assistant, content a string or a list of
  {"type": "text", "text": ...} parts;
- `temperature` defaults to 0 (greedy), unlike OpenAI's 1: the server's point is reproducible
  output; values below 1e-5 are greedy (as vLLM does); at most 2;
- `stop`: a string or up to 4 strings (the text is cut before the stop string);
- extensions: `deterministic` (bool), `determinism` {policy, tau, repair, strict,
  verifier_precision, defer, window, group}, `ignore_eos` (bool);
- unknown fields are refused (a misspelt `determinism` must not silently run undeterministic).
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP = 4
MAX_STOP_LEN = 256
GREEDY_BELOW = 1e-5
INT64 = 2 ** 63


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
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (not supported by this server)"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request", first


# --- pieces --------------------------------------------------------------------------

class DeterminismOptions(BaseModel):
    """The `determinism` block: which policy protects this request, and how. Unset fields take
    the server's default policy and `PolicySpec`'s defaults; `PolicySpec` validates the values."""
    model_config = ConfigDict(extra="forbid", strict=True)

    policy: str | None = None
    tau: float | None = Field(default=None, ge=0)   # inf: verify every step
    repair: str | None = None
    strict: bool | None = None
    verifier_precision: str | None = None
    defer: int | None = Field(default=None, ge=0, le=1024)
    window: int | None = Field(default=None, ge=1, le=256)
    group: int | None = Field(default=None, ge=1, le=64)

    def spec_options(self) -> dict:
        """The options given, as `PolicySpec` keywords."""
        given = self.model_dump(exclude_none=True, exclude={"policy"})
        if "verifier_precision" in given:
            given["precision"] = given.pop("verifier_precision")
        return given


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra keys clients send along (name, tool_calls: null, ...) are ignored
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# --- bodies ----------------------------------------------------------------------------

# OpenAI fields accepted only at their neutral values: field -> (accepted, message otherwise).
NEUTRAL = {
    "n": ((None, 1), "only n=1 is supported (got {v}); send one request per completion"),
    "best_of": ((None, 1), "only best_of=1 is supported (got {v})"),
    "top_p": ((None, 1), "only top_p=1 is supported (got {v}): sampling is full-vocabulary Gumbel-max"),
    "presence_penalty": ((None, 0), "penalties are not supported (got {v}); use 0 or leave it out"),
    "frequency_penalty": ((None, 0), "penalties are not supported (got {v}); use 0 or leave it out"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "logprobs": ((None, 0), "logprobs are not supported"),
    "top_logprobs": ((None, 0), "logprobs are not supported"),
}


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, allow_inf_nan=False)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    deterministic: bool | None = None
    determinism: DeterminismOptions | None = None
    ignore_eos: bool = False

    @field_validator(*NEUTRAL, check_fields=False)  # some are declared by one subclass only
    @classmethod
    def _neutral(cls, v, info):
        accepted, message = NEUTRAL[info.field_name]
        if v not in accepted:
            raise ValueError(message.format(v=v))
        return v

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
        return 0.0 if t < GREEDY_BELOW else float(t)

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def tokens_limit(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Common):
    prompt: Any
    best_of: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        """A string or a list of token ids; a list holding exactly one of those is unwrapped."""
        if v is None:
            raise ValueError("a prompt is required")
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        elif isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
            raise ValueError(f"one prompt per request (got {len(v)}); send one request each")
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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: bool | None = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; give one")
        return self

    def tokens_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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
