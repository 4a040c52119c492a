"""Reasoning (`server/parsers/reasoning.py`): a `<think>` family's reasoning goes to `reasoning_content` (chat,
whole and streamed) and to a `reasoning` item (Responses); `chat_template_kwargs.enable_thinking` reaches the
template; an output constraint holds the answer only after the reasoning ends (`engine/structured.AfterReasoning`).

The parser is checked on text split at every position; the grammar's deferral on the embedded tokenizer; the
server on a tiny random Qwen3 (transformers' Qwen3Config, the embedded tokenizer, whose ChatML tokens Qwen3's
template writes) under a chat template of Qwen3's form, and one of DeepSeek-R1's distills' form (it opens
`<think>` in the generation prompt). No Qwen3 chat template ships in the installed packages or the tests, so
the two are written here in those templates' shapes; QWEN3_TEMPLATE=<a real template file> runs the Qwen3
cases on that one instead."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from margingate.server.parsers.answer import Answer, PlainParser
from margingate.server.parsers.call_parser import CallParser
from margingate.server.parsers.reasoning import Reasoning, ReasoningParser, template_family

QWEN3_FORM = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not \
loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% set content = message.content or '' %}{% if '</think>' in content %}{% set content = \
content.split('</think>')[-1].lstrip('\\n') %}{% endif %}{{ content }}{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{%- endif %}"""
# DeepSeek-R1's distills open the reasoning in the generation prompt: the answer starts inside it
R1_FORM = QWEN3_FORM.replace("{% if enable_thinking is defined", "<think>\n{% if enable_thinking is defined")
ANSWERS = [  # (starts inside its reasoning, text, (reasoning, content))
    (False, "<think>\nI should greet.\n</think>\n\nHello there.", ("I should greet.", "Hello there.")),
    (False, "  Hello, no reasoning.", (None, "  Hello, no reasoning.")),
    (False, "<thinking> is a word", (None, "<thinking> is a word")),
    (True, "First this, then that.\n</think>\n\nDone.", ("First this, then that.", "Done.")),
    (True, "Still thinking when the tokens ran out", ("Still thinking when the tokens ran out", None)),
]


def read(inside: bool, text: str, cuts=(), tools: bool = False) -> tuple:
    inner = CallParser({"get_time"}, 1) if tools else PlainParser()
    parser, answer, start = ReasoningParser(Reasoning("<think>", "</think>", inside), inner), Answer(tools), 0
    for end in [*sorted(cuts), len(text)]:
        answer.take(parser.feed(text[start:end]))
        start = end
    answer.take(parser.finish())
    return (answer.reasoning, answer.message()["content"], answer.calls and answer.calls[0]["function"],
            parser.reasoning_end)


@pytest.mark.parametrize("inside, text, expected", ANSWERS)
def test_reasoning_is_split_from_the_answer_whatever_the_split(inside, text, expected):
    assert read(inside, text)[:2] == expected
    closed = text.find("</think>")
    assert read(inside, text)[3] == (closed + len("</think>") if closed >= 0 else len(text) if expected[0] else 0)
    for cut in range(1, len(text)):
        assert read(inside, text, [cut]) == read(inside, text), cut
    assert read(inside, text, range(1, len(text))) == read(inside, text)


def test_a_call_after_the_reasoning_is_a_call():
    text = ('<think>\nThe user wants the time.\n</think>\n\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    whole = read(False, text, tools=True)
    assert whole[:3] == ("The user wants the time.", None, {"name": "get_time", "arguments": "{}"})
    assert all(read(False, text, [cut], tools=True) == whole for cut in range(1, len(text)))


def test_where_the_answer_starts_is_read_from_the_prompt():
    assert template_family(QWEN3_FORM) == template_family(R1_FORM) == "think"
    assert template_family("{{ messages }}") is None and template_family(None) is None
    assert template_family(None, writes_harmony=True) == "harmony"
    assert Reasoning.of("think", "<|im_start|>assistant\n") == Reasoning("<think>", "</think>", inside=False)
    assert Reasoning.of("think", "<|im_start|>assistant\n<think>\n").inside
    assert Reasoning.of("think", "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # thinking off
    assert not Reasoning.of("think", "</think>\n\nOld answer<|im_end|>\n<|im_start|>assistant\n").inside


def test_the_grammar_holds_the_answer_only_after_the_reasoning(llm):
    """A JSON schema under `AfterReasoning` on the embedded tokenizer (where `<think>` is several tokens)."""
    from margingate.engine.structured import AfterReasoning
    from margingate.options.structured import StructuredOutput

    schema = StructuredOutput(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    opening, closing = llm.tokenizer.encode("<think>"), llm.tokenizer.encode("</think>")
    reasoning, answer = llm.tokenizer.encode("Hmm, a number."), llm.tokenizer.encode('{"a": 1')
    stop = frozenset()
    plain = llm.grammars.matcher(schema)
    inside = llm.grammars.matcher(AfterReasoning(schema, (), tuple(closing)))
    assert bool(inside.allowed(reasoning, stop).all())  # free while it reasons
    after = reasoning + closing
    assert torch.equal(inside.allowed(after, stop), plain.allowed([], stop))
    assert torch.equal(inside.allowed(after + answer, stop), plain.allowed(answer, stop))
    may_open = llm.grammars.matcher(AfterReasoning(schema, tuple(opening), tuple(closing)))
    first = may_open.allowed([], stop)
    assert bool(first[opening[0]]) and torch.equal(first & ~onehot(opening[0], first), plain.allowed([], stop)
                                                   & ~onehot(opening[0], first))
    assert torch.equal(may_open.allowed(answer, stop), plain.allowed(answer, stop))  # no reasoning: the grammar
    if len(opening) > 1:  # an opening begun is finished
        assert may_open.allowed(opening[:1], stop).nonzero().flatten().tolist() == [opening[1]]
    assert bool(may_open.allowed(opening + reasoning, stop).all())
    assert may_open.error is None and inside.error is None


def onehot(token: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[token] = True
    return out


# --- a tiny random Qwen3 behind the server --------------------------------------------------------------

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
tf = pytest.importorskip("transformers")

from server_fixtures import StreamingLoad, make_server  # noqa: E402

from margingate.options import deterministic_policies  # noqa: E402

POLICIES = [p for p in deterministic_policies() if p != "auto"]
ASK = [{"role": "user", "content": "Is the sky blue?"}]
JSON = {"type": "json_schema", "json_schema": {"name": "yes", "schema": {
    "type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}}}


def qwen3_folder(out: Path, model_dir: Path, template: str) -> Path:
    """A random Qwen3 (2 layers, bf16-representable weights, seed 0) with the embedded tokenizer and `template`."""
    torch.manual_seed(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    config = tf.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                            max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=True,
                            bos_token_id=1, eos_token_id=2)
    model = tf.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(out)
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy2(f, out / f.name)
    (out / "chat_template.jinja").write_text(template)
    return out


def served(tmp_path_factory, model_dir, template: str, name: str):
    from margingate.llm import LLM

    folder = qwen3_folder(tmp_path_factory.mktemp(name), model_dir, template)
    srv = make_server(LLM(str(folder), max_num_seqs=8, max_model_len=512), slots=8, default_max_tokens=24)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=180.0)
    return srv, client


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, model_dir):
    real = os.environ.get("QWEN3_TEMPLATE")
    srv, client = served(tmp_path_factory, model_dir, Path(real).read_text() if real else QWEN3_FORM, "qwen3")
    yield srv, client
    srv.stop()


@pytest.fixture(scope="module")
def r1(tmp_path_factory, model_dir):
    srv, client = served(tmp_path_factory, model_dir, R1_FORM, "r1")
    yield srv, client
    srv.stop()


def create(client, policy="batch-invariant", **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=client.model_name,
                                          extra_body={"determinism": {"policy": policy}, **kw.pop("extra", {})}, **kw)


@pytest.fixture(autouse=True)
def model_name(request):
    for name in ("qwen3", "r1"):
        if name in request.fixturenames:
            srv, client = request.getfixturevalue(name)
            client.model_name = srv.state.model_id


def test_enable_thinking_reaches_the_template(qwen3):
    srv, client = qwen3
    import httpx

    def prompt(**kwargs) -> str:
        r = httpx.post(f"{srv.url}/tokenize", json={"messages": ASK, "chat_template_kwargs": kwargs}, timeout=60)
        return srv.state.context.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)

    assert prompt(enable_thinking=False).endswith("<think>\n\n</think>\n\n") and not prompt().endswith("</think>\n\n")
    answer = create(client, extra={"chat_template_kwargs": {"enable_thinking": False}})
    off = answer.choices[0]
    assert off.message.model_extra.get("reasoning_content") is None  # thinking off: no reasoning is read
    assert answer.usage.completion_tokens_details is None
    assert off.message.content == srv.state.context.tokenizer.decode(off.model_extra["token_ids"])


@pytest.mark.parametrize("policy", POLICIES)
def test_reasoning_content_streamed_is_the_whole_bitwise_beside_streaming_clients(r1, policy):
    """R1's form: the answer starts inside its reasoning; the random model never closes it, so all its text is
    reasoning, whole and streamed alike."""
    srv, client = r1
    answer = create(client, policy)
    whole = answer.choices[0]
    assert answer.usage.completion_tokens_details.reasoning_tokens == answer.usage.completion_tokens
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and reasoning == srv.state.context.tokenizer.decode(
        whole.model_extra["token_ids"]).strip() and not whole.message.content
    with StreamingLoad(srv, 3, model=client.model_name, max_tokens=16):
        chunks = list(create(client, policy, stream=True))
    streamed = "".join(c.delta.model_extra.get("reasoning_content") or "" for ch in chunks for c in ch.choices)
    assert streamed == reasoning and not "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert len([1 for ch in chunks for c in ch.choices if c.delta.model_extra.get("reasoning_content")]) > 1


def test_a_constraint_waits_for_the_reasoning_to_end(r1, qwen3):
    """Inside the reasoning every token is free: the constrained answer's tokens are the unconstrained one's
    (the random model never closes it). With thinking off the same schema holds the answer from its first token."""
    srv, client = r1
    free = create(client, max_tokens=16).choices[0]
    held = create(client, max_tokens=16, response_format=JSON).choices[0]
    assert held.model_extra["token_ids"] == free.model_extra["token_ids"]
    _, client = qwen3
    off = create(client, max_tokens=64, response_format=JSON,
                 extra={"chat_template_kwargs": {"enable_thinking": False}})
    text = off.choices[0].message.content
    assert text.lstrip().startswith("{") and "structured_output_error" not in off.model_extra["determinism"]


def test_responses_carry_a_reasoning_item_whole_and_streamed(r1):
    srv, client = r1
    kw = dict(model=client.model_name, input="Is the sky blue?", max_output_tokens=24,
              extra_body={"determinism": {"policy": "batch-invariant"}})
    whole = client.responses.create(**kw)
    [item] = [i for i in whole.output if i.type == "reasoning"]
    assert whole.output[0].type == "reasoning" and item.content[0].text
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens
    events = list(client.responses.create(**kw, stream=True))  # cut by max_output_tokens: response.incomplete
    final = events[-1].response
    assert events[-1].type == "response.incomplete" == f"response.{whole.status}"
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[0].type == "reasoning" and added[0].id == final.output[0].id
    assert deltas == done.text == final.output[0].content[0].text == item.content[0].text
    again = client.responses.create(**{**kw, "input": [{"role": "user", "content": "Is the sky blue?"},
                                                       item.model_dump(exclude_none=True),
                                                       {"role": "user", "content": "Why?"}]})
    assert again.status in ("completed", "incomplete")  # a reasoning item sent back is accepted


def test_responses_logprobs_leave_the_reasoning_out(r1):
    """The output text's logprobs are its tokens', not the reasoning's: the random model never closes its
    reasoning, so chat gives every token's logprobs and the Responses text none, whole and streamed."""
    srv, client = r1
    kw = dict(model=client.model_name, input="Is the sky blue?", max_output_tokens=12, top_logprobs=1,
              include=["message.output_text.logprobs"], extra_body={"determinism": {"policy": "batch-invariant"}})
    whole = client.responses.create(**kw)
    [message] = [i for i in whole.output if i.type == "message"]
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens
    assert message.content[0].logprobs == []
    chat = create(client, max_tokens=12, logprobs=True, top_logprobs=1).choices[0]
    assert len(chat.logprobs.content) == whole.usage.output_tokens
    events = list(client.responses.create(**kw, stream=True))
    assert all(e.logprobs == [] for e in events if e.type in ("response.output_text.delta",
                                                              "response.output_text.done"))
