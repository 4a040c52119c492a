"""`POST /v1/completions`: prompts as text or token ids (each encoded as it is, no template), n samples of
each; the answer's text, `echo` (the prompt, and its logprobs, before it) and the legacy logprobs object
(tokens, token_logprobs, top_logprobs, text_offset); streamed, one chunk of text per release, the echoed
prompt first."""
from __future__ import annotations

from collections.abc import Iterator

from starlette.concurrency import run_in_threadpool

from ...data.prompts import Prompt
from ..core.events import Outcome
from ..core.jobs import Choice, Job
from ..core.state import ServerState
from ..core.streaming import ChunkWriter
from ..core.tools import ToolPlan
from ..protocol.bodies import CompletionRequest
from ..protocol.common import BadRequest
from ..protocol.logprobs import merge_completion
from .endpoint import Endpoint


class CompletionsEndpoint(Endpoint):
    body = CompletionRequest
    id_prefix = "cmpl-"
    prompt_param = "prompt"
    logprob_names = {"prompt_logprobs": "logprobs"}
    object_name = chunk_object = "text_completion"

    async def prompts(self, state: ServerState, params, plan: ToolPlan) -> list[tuple[list[int], str | None]]:
        out = []
        for i, p in enumerate(params.prompt):
            if isinstance(p, list):
                check_ids(p, state.context.vocab_size, "prompt" if len(params.prompt) == 1 else f"prompt.{i}")
            ids = p if isinstance(p, list) else await run_in_threadpool(state.context.encode_prompt,
                                                                        Prompt("text", None, p, "http"))
            out.append((ids, p if isinstance(p, str) else None))
        return out

    # --- the answer -----------------------------------------------------------------------------------
    def choice_body(self, state: ServerState, job: Job, choice: Choice, o: Outcome) -> dict:
        body = {"index": choice.index, "finish_reason": o.finish_reason, "token_ids": o.ids}
        echo = None
        if job.echo:
            echo = (echo_text(state, choice), o.prompt_logprobs or o.result.prompt_logprobs)
        if job.echo or job.params.return_token_ids:
            body["prompt_token_ids"] = choice.request.prompt_ids
        body["text"] = (echo[0] if echo else "") + o.text
        body["logprobs"] = self.logprobs_body(state, choice, o, echo)
        return body

    def logprobs_body(self, state: ServerState, choice: Choice, outcome: Outcome, echo: tuple | None):
        """The legacy logprobs object; `echo` = (prompt text, prompt logprobs)."""
        if choice.request.sampling.logprobs is None:
            return None
        parts, fmt = [], state.formatter
        if echo is not None:
            prompt = choice.request.prompt_ids
            parts.append(fmt.completion(prompt, echo[1], fmt.offsets(prompt)))
        start = len(echo[0]) if echo is not None else 0
        parts.append(fmt.completion(outcome.ids, outcome.logprobs, [start + i for i in outcome.offsets]))
        return merge_completion(parts)

    def content(self, text: str | None, delta: dict, first: bool) -> dict:
        return {"text": text or ""}

    def opening_chunks(self, writer: ChunkWriter, choice: Choice) -> Iterator[dict]:
        """With return_token_ids, a first chunk with the prompt's ids and no text (vLLM sends them first)."""
        if writer.job.params.return_token_ids:
            out = writer.chunk(choice, "", [])
            out["choices"][0]["prompt_token_ids"] = choice.request.prompt_ids
            yield out

    def stream_logprobs(self, writer: ChunkWriter, choice: Choice, ids: list[int], lps: list, offsets: list[int]):
        return writer.state.formatter.completion(ids, lps, [writer.text_start[choice.index] + i for i in offsets])

    def echo_chunk(self, writer: ChunkWriter, choice: Choice, prompt_lps: list) -> dict:
        """The prompt as it was sent, with its logprobs: the stream's first text for this choice."""
        text = echo_text(writer.state, choice)
        prompt = choice.request.prompt_ids
        out = writer.chunk(choice, text, prompt, prompt_lps, offsets=writer.state.formatter.offsets(prompt))
        out["choices"][0]["token_ids"] = []
        writer.text_start[choice.index] = len(text)
        return out


def check_ids(ids: list[int], vocab: int, param: str) -> None:
    """Before the engine sees them: an id outside the vocabulary would index past the embedding."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"{param}: token id {ids[bad]} at position {bad} is outside the vocabulary (ids 0.."
                         f"{vocab - 1})", param=param, code="token_id_out_of_range")


def echo_text(state: ServerState, choice: Choice) -> str:
    return choice.prompt_text if choice.prompt_text is not None else state.context.decode(choice.request.prompt_ids)


COMPLETIONS = CompletionsEndpoint()
