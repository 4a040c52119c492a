"""A request body -> a `Job`: the body read within its size limit, strict JSON validated into the
protocol's models, the model id checked, the policy built, the seed rule, the prompt's token ids and
max_tokens against the room left in the context. Every refusal is a `BadRequest` naming its field."""
from __future__ import annotations

import uuid
from dataclasses import replace

from fastapi import Request as HTTPRequest
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ...engine import Request
from ...engine.policy import Policy
from ...engine.structured import AfterReasoning
from ...options import (
    PolicyOptionError,
    PolicySpec,
    SamplingError,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeError,
    deterministic_policies,
)
from ...options.structured import StructuredError, StructuredOutput
from ..parsers.reasoning import Reasoning
from ..protocol.common import BadRequest, CommonBody, parse_json_body, validation_message
from .constraints import compiled
from .jobs import Choice, Job
from .state import ServerState
from .tools import ToolPlan


async def read_body(req: HTTPRequest, limit: int) -> bytes:
    """The whole body; 413 as soon as it is known to be over `limit` bytes (declared or read)."""
    declared = req.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body too large (limit {limit} bytes)", status=413, code="body_too_large")
    chunks, size = [], 0
    async for chunk in req.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body too large (limit {limit} bytes)", status=413, code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def json_object(raw: bytes) -> dict:
    """The body, which must be a JSON object."""
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def validate(state: ServerState, body: dict, model_cls: type[CommonBody]) -> CommonBody:
    """The body's JSON object as the endpoint's pydantic model, for the model this server serves."""
    try:
        params = model_cls.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise BadRequest(message, param=param) from None
    if params.model is not None and params.model not in state.model_names:
        raise BadRequest(f"the model {params.model!r} does not exist; this server serves {state.model_id!r}",
                         param="model", status=404, code="model_not_found")
    return params


async def read_params(state: ServerState, req: HTTPRequest, model_cls: type[CommonBody]) -> CommonBody:
    """The request's body, read within its size limit and validated as the endpoint's model."""
    return validate(state, json_object(await read_body(req, state.config.max_body_bytes)), model_cls)


def build_policy(state: ServerState, params) -> Policy:
    """The request's policy. Streamed or not, it is the same policy: a strict one releases verified
    tokens only, so the stream is the non-streamed answer. `"deterministic": true` is refused unless
    the options promise it (`PolicySpec.promise`, the one source the report reads too)."""
    block, asked = params.determinism, params.deterministic
    if asked is None and block is None and state.config.deterministic_by_default:
        asked = True
    if block is None and not asked:
        return state.context.policy("fast")
    name = block.policy if block is not None and block.policy is not None else state.config.default_policy
    options = block.spec_options() if block is not None else {}
    try:
        spec = PolicySpec(name, **options).resolve(state.context.device)
    except PolicyOptionError as exc:
        raise BadRequest(str(exc), param=f"determinism.{exc.option}") from None
    promises = spec.deterministic  # with these options: a non-strict margin promises nothing
    if asked is False and promises:
        raise BadRequest('"deterministic": false contradicts the "determinism" block; drop one',
                         param="deterministic")
    if asked and not promises:
        raise BadRequest(not_deterministic(spec), param=f"determinism.{unpromising_option(spec)}")
    return state.context.policy(spec)


def unpromising_option(spec: PolicySpec) -> str:
    """The option that makes `spec` promise nothing: the policy, or (for margin) repair or strict."""
    if not PolicySpec(spec.name).deterministic:
        return "policy"
    return "repair" if spec.repair != "replay" else "strict"


def not_deterministic(spec: PolicySpec) -> str:
    option = unpromising_option(spec)
    if option == "policy":
        return (f'"deterministic": true needs a policy that promises determinism (a batch-invariant one: '
                f'{", ".join(deterministic_policies())}), not "{spec.name}"')
    value = {"repair": f'"{spec.repair}"', "strict": "false"}[option]
    return (f'"deterministic": true with policy "{spec.name}" needs repair "replay" and strict true '
            f"(a flip the gate misses is never taken back otherwise), not {option} {value}")


def check_seed(deterministic: bool, temperature: float, seed: int | None) -> None:
    """Sampling is reproducible only for a given seed: a deterministic sampled request must name one."""
    if deterministic and temperature > 0 and seed is None:
        raise BadRequest("a deterministic request with temperature > 0 needs a seed: sampling is "
                         "reproducible only for a given seed (or set temperature to 0 for greedy)",
                         param="seed", code="seed_required")


def sampling_params(state: ServerState, params, names: dict[str, str]) -> SamplingParams:
    """The body's sampling and logprobs options, checked by `SamplingParams` (the one validator);
    a refusal names this protocol's field (`names`: an option's field where they differ)."""
    try:
        sampling = SamplingParams(**params.sampling_options())
        sampling.check_vocab(state.context.vocab_size)
    except SamplingError as exc:
        raise BadRequest(str(exc), param=names.get(exc.option, exc.option)) from None
    return sampling.seeded()  # one seed for the request: sample j of n takes seed + j


def output_constraint(state: ServerState, params, plan: ToolPlan):
    """The body's constraint (`response_format`, vLLM's fields) or its tools' (the plan's: the calls' format),
    compiled. With `auto` the body's wins (the answer is then held to it, not to calls); with calls
    forced, both at once is a 400."""
    by_tools = plan.constraint
    structured = compiled(state.context.grammars, params)
    if by_tools is not None and structured is not None:
        if plan.mode == "auto":
            return structured
        raise BadRequest("tool_choice constrains the output already: drop the other constraint", param="tool_choice")
    if by_tools is not None:
        try:
            state.context.grammars.compile(by_tools)
        except StructuredError as exc:
            raise BadRequest(f"tools: a function's parameters do not compile: {exc}", param="tools") from None
    return by_tools or structured


def speculative_config(state: ServerState, params) -> SpeculativeConfig | None:
    """The body's `speculative` block, checked by `SpeculativeConfig`; a refusal names its field."""
    if params.speculative is None:
        return None
    try:
        config = SpeculativeConfig(**params.speculative.model_dump(exclude_none=True))
        config.check(state.context.draft)
        return config
    except SpeculativeError as exc:
        raise BadRequest(str(exc), param=f"speculative.{exc.option}") from None


def token_budget(state: ServerState, params, n_prompt: int) -> int:
    """max_tokens, or the server's default within the room the context leaves; refused if it does not fit."""
    max_len = state.context.max_len
    room = max_len - n_prompt  # < 1: the engine refuses the prompt, with its message
    max_tokens = params.tokens_limit()
    if max_tokens is None:
        return max(1, min(state.config.default_max_tokens, room))
    if room >= 1 and max_tokens > room:
        raise BadRequest(f"max_tokens={max_tokens} does not fit: the prompt has {n_prompt} tokens and the "
                         f"context {max_len} positions, so at most {room} new tokens",
                         param="max_completion_tokens" if params.max_completion_tokens is not None else "max_tokens")
    return max_tokens


async def build_job(state: ServerState, endpoint, params, id_prefix: str | None = None) -> Job:
    """A validated body as the `Job` its endpoint means (its prompts, tools and reasoning); raises BadRequest."""
    policy = build_policy(state, params)
    sampling = sampling_params(state, params, endpoint.logprob_names)
    plan = await run_in_threadpool(endpoint.tool_plan, state, params)  # the grammar's markers read the tokenizer
    structured = await run_in_threadpool(output_constraint, state, params, plan)
    if structured is not None:
        if params.min_tokens:  # masking the end where the grammar allows nothing else would leave no token
            raise BadRequest("min_tokens with an output constraint or forced tool calls is not supported",
                             param="min_tokens")
        sampling = replace(sampling, structured=structured)
    check_seed(policy.deterministic, sampling.temperature, params.seed)
    speculative = speculative_config(state, params)
    encoded = await endpoint.prompts(state, params, plan)
    reasoning = await run_in_threadpool(endpoint.reasoning, state, encoded[0][0])
    if structured is not None and reasoning is not None and not reasoning.harmony:  # after its reasoning
        sampling = replace(sampling, structured=await run_in_threadpool(after_reasoning, state, structured, reasoning))
    rid = f"{id_prefix or endpoint.id_prefix}{uuid.uuid4().hex}"
    n, choices = params.choices_per_prompt, []
    try:
        for p, (ids, text) in enumerate(encoded):
            max_tokens = token_budget(state, params, len(ids))
            for j in range(n):  # samples after the first copy its prompt K/V (share_prefill)
                index = p * n + j
                request = Request(list(ids), max_tokens, policy, ignore_eos=params.ignore_eos,
                                  request_id=rid if index == 0 else f"{rid}-{index}", sampling=sampling.for_sample(j),
                                  share_prefill=choices[-j].request.request_id if j else None,
                                  speculative=speculative)
                choices.append(Choice(index, p, text, request))
    except BadRequest:
        raise
    except ValueError as exc:
        raise BadRequest(str(exc), param=endpoint.prompt_param) from None
    return Job(endpoint, params, policy, rid, choices, plan, ignored=params.ignored_fields(), reasoning=reasoning)


def after_reasoning(state: ServerState, structured: StructuredOutput, reasoning: Reasoning) -> AfterReasoning:
    """The constraint, free until the answer's reasoning closes (engine/structured.py)."""
    opening = () if reasoning.inside else tuple(state.context.encode(reasoning.opening))
    return AfterReasoning(structured, opening, tuple(state.context.encode(reasoning.closing)))
