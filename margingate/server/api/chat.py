"""`POST /v1/chat/completions`: the messages through the model's chat template (tools offered as tools.py says),
n samples; each answer read by its parser (reasoning.py, then call_parser.py) into the assistant message's
content, `reasoning_content` and `tool_calls`, with chat's logprobs (`content`: token, logprob, bytes,
top_logprobs); streamed as deltas, the first naming the role."""
from __future__ import annotations

from collections.abc import Iterator

from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from ...data.prompts import Prompt
from ..core import tools
from ..core.events import Outcome
from ..core.jobs import Choice, Job
from ..core.state import ServerState
from ..core.streaming import ChunkWriter
from ..parsers.reasoning import Reasoning
from ..protocol.bodies import ChatCompletionRequest
from ..protocol.common import BadRequest
from .endpoint import Endpoint


class ChatEndpoint(Endpoint):
    body = ChatCompletionRequest
    id_prefix = "chatcmpl-"
    prompt_param = "messages"
    logprob_names = {"logprobs": "top_logprobs"}
    object_name, chunk_object = "chat.completion", "chat.completion.chunk"

    def tool_plan(self, state: ServerState, params) -> tools.ToolPlan:
        return tools.plan(params, state.tool_format, state.context.grammars)

    async def prompts(self, state: ServerState, params, plan: tools.ToolPlan) -> list[tuple[list[int], str | None]]:
        """The one prompt the template makes of the messages and the tools the plan offers."""
        chat = Prompt("chat", tuple(tools.message_dicts(params, plan)), None, "http")
        offered = tools.template_tools(plan)
        try:
            ids = await run_in_threadpool(state.context.encode_prompt, chat, offered, **params.template_options())
        except TemplateError as exc:  # chat_template_kwargs or a message the template refuses
            raise BadRequest(f"the chat template failed on this request: {exc}", param="messages") from None
        return [(ids, None)]

    def reasoning(self, state: ServerState, prompt_ids: list[int]) -> Reasoning | None:
        if state.reasoning_family is None:
            return None
        return Reasoning.of(state.reasoning_family, state.context.prompt_tail(prompt_ids))

    # --- the answer -----------------------------------------------------------------------------------
    def choice_body(self, state: ServerState, job: Job, choice: Choice, o: Outcome) -> dict:
        logprobs = state.formatter.chat(o.logprobs) if choice.request.sampling.logprobs is not None else None
        return {"index": choice.index, "finish_reason": o.finish_reason, "token_ids": o.ids,
                "message": {"role": "assistant", **o.answer.message()}, "logprobs": logprobs}

    def top_fields(self, job: Job) -> dict:
        """vLLM's place for the prompt's ids on chat: beside the choices (one prompt, whatever n)."""
        return {"prompt_token_ids": job.choices[0].request.prompt_ids} if job.params.return_token_ids else {}

    def opening_chunks(self, writer: ChunkWriter, choice: Choice) -> Iterator[dict]:
        yield {**writer.chunk(choice, "", [], first=True), **self.top_fields(writer.job)}

    def content(self, text: str | None, delta: dict, first: bool) -> dict:
        return {"delta": {**({"role": "assistant"} if first else {}), **({} if text is None else {"content": text}),
                          **delta}}

    def stream_logprobs(self, writer: ChunkWriter, choice: Choice, ids: list[int], lps: list, offsets: list[int]):
        return writer.state.formatter.chat(lps)


CHAT = ChatEndpoint()
