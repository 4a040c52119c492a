"""Request bodies of the OpenAI-compatible API, validated (pydantic): the fields every generation body shares
(`CommonBody`; completions' and chat's own: `bodies.py`), the strict JSON reader, errors, and response helpers.

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
  ngram_min}, `ignore_eos` (bool), `top_k`, `min_p`, `repetition_penalty`, vLLM's `return_token_ids`
  (`prompt_token_ids` in the answer: on each completions choice, at the top of a chat answer);
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
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import sdk_fields
from .formats import ConstraintFields

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


# --- bodies ----------------------------------------------------------------------------

class CommonBody(ConstraintFields):
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
    # vLLM's: the prompt's token ids in the answer too (the output's, `token_ids`, are always there)
    return_token_ids: bool | None = None

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
