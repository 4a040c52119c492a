"""The same logprobs at any thread count, and the same tokens and logprobs on any linear path. One
heterogeneous batch in which every request has another deterministic policy is decoded by engines at 1 and
4 torch threads (4 oversubscribes a 2-core machine; this process runs at its default, all cores), and in fresh
processes at default threads with each linear path this CPU has forced (`MARGINGATE_FORCE_ISA`, read when the
kernels load). Each request must report, bitwise, the logprobs that scoring the tokens of the request decoded
alone by the reference gives in this (default-threads, default-path) process; on a forced path, those tokens
too. That the tokens do not depend on the thread count is the contract's (determinism/test_contract.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from prompt_sets import SPREAD8 as PICKS

from margingate.engine import Request
from margingate.engine.engine import Engine, EngineConfig
from margingate.kernels.invariant import PATHS, usable_paths
from margingate.options import SamplingParams

DEFAULT_PATH = usable_paths("bf16")[0]

POLICIES = ("reference", "batch-invariant", "margin", "verify-all", "dvr")
NEW_TOKENS = 32

SCRIPT = """
import json, sys
from margingate.data.prompts import builtin_prompts
from margingate.options import SamplingParams
from margingate.llm import LLM

threads, policies, picks, n = int(sys.argv[1]), sys.argv[2].split(","), json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(max_num_seqs=len(picks), num_threads=threads, prefill_chunk=16)
prompts = [builtin_prompts()[i] for i in picks]
reqs = llm.requests(prompts, max_new_tokens=n, ignore_eos=True, sampling=SamplingParams(logprobs=2))
for k, r in enumerate(reqs):
    r.policy = llm.policy(policies[k % len(policies)])
out = llm.engine.generate(reqs)
print(json.dumps({"threads": llm.engine.num_threads, "tokens": [r.token_ids for r in out],
                  "logprobs": [[t.logprob for t in r.logprobs] for r in out]}))
"""


def decode_in_fresh_process(threads: int, isa: str | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if isa:
        env["MARGINGATE_FORCE_ISA"] = isa
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads), ",".join(POLICIES), json.dumps(PICKS),
                          str(NEW_TOKENS)], capture_output=True, text=True, env=env, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def alone(references):
    return references.tokens(PICKS, NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def scored(llm, prompts, alone):
    """The reference tokens scored in this process: the logprobs every run must report."""
    ids = [llm.tokenizer.encode_prompt(prompts[i]) for i in PICKS]
    return [s.logprobs for s in llm.score_batch(list(zip(ids, alone)))]


@pytest.mark.parametrize("threads", [1, pytest.param(4, marks=pytest.mark.slow)])  # 1 against the default
def test_same_logprobs_at_any_thread_count(llm, prompts, threads, scored):
    """The logprobs each request reports (of the tokens it generated) are those scored here, bitwise."""
    before = torch.get_num_threads()
    try:
        engine = Engine(llm.model, EngineConfig(max_num_seqs=len(PICKS), max_model_len=256, num_threads=threads,
                                                prefill_chunk=16), lambda: llm.policy("fast"))
        out = engine.generate([Request(llm.tokenizer.encode_prompt(prompts[i]), NEW_TOKENS,
                                       llm.policy(POLICIES[k % len(POLICIES)]), ignore_eos=True,
                                       request_id=f"r{k}", sampling=SamplingParams(logprobs=2))
                               for k, i in enumerate(PICKS)])
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    for k, (r, want) in enumerate(zip(out, scored)):
        policy = POLICIES[k % len(POLICIES)]
        assert [t.logprob for t in r.logprobs] == want, f"logprobs of request {k} ({policy}) at {threads} threads"


@pytest.mark.slow  # a fresh process per path; test_kernels.py holds every path to the scalar order
@pytest.mark.parametrize("isa", [p for p in PATHS["bf16"] if p != DEFAULT_PATH])
def test_same_tokens_on_every_linear_path(isa, alone, scored):
    """The other linear paths, forced: the same tokens as the default path's. A path this CPU lacks skips."""
    if isa not in usable_paths("bf16"):
        pytest.skip(f"this CPU cannot run the {isa} path (it runs {', '.join(usable_paths('bf16'))})")
    run = decode_in_fresh_process(os.cpu_count() or 1, isa)
    for k, (got, want) in enumerate(zip(run["tokens"], alone)):
        assert got == want, f"request {k} ({POLICIES[k % len(POLICIES)]}) on the {isa} path"
        assert run["logprobs"][k] == scored[k], f"logprobs of request {k} on the {isa} path"


SAMPLED = """
import json
import torch
from margingate.data.prompts import builtin_prompts
from margingate.options import SamplingParams
from margingate.llm import LLM

llm = LLM(max_num_seqs=4, policy="batch-invariant")
sp = SamplingParams(temperature=1.0, seed=5, top_p=0.9, top_k=50, min_p=0.02, frequency_penalty=0.3, logprobs=2)
reqs = llm.requests([builtin_prompts()[i] for i in (0, 3, 7, 11)], max_new_tokens=24, sampling=sp)
out = llm.engine.generate(reqs)
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "outputs": [[r.token_ids, [t.logprob for t in r.logprobs]] for r in out]}))
"""


@pytest.mark.slow  # two fresh processes
def test_samples_do_not_depend_on_torchs_cpu_kernels():
    """Seeded sampling still runs torch's CPU kernels: its generator draws the Gumbel noise's uniforms
    (mt19937: one stream on every ISA) and its ops divide by the temperature, sort and mask for the
    filters; the noise's logs, the probabilities and the logprobs are csrc/logits.cpp's. Forcing torch's
    AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) where it picks AVX-512 must not change a sample or a
    logprob. Where torch runs AVX2 anyway there is nothing to compare: skipped."""
    def sample(env):
        out = subprocess.run([sys.executable, "-c", SAMPLED], capture_output=True, text=True, timeout=600,
                             check=True, env={**os.environ, **env})
        return json.loads(out.stdout.strip().splitlines()[-1])
    default = sample({})
    if default["capability"] in ("DEFAULT", "AVX2"):
        pytest.skip(f"torch runs its {default['capability']} kernels here: nothing else to force")
    forced = sample({"ATEN_CPU_CAPABILITY": "avx2"})
    assert forced["capability"] == "AVX2"
    assert forced["outputs"] == default["outputs"]
