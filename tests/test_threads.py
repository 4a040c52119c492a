"""The same tokens at any thread count: fresh processes at 1, 2 and 4 torch threads (4
oversubscribes a 2-core machine) decode one heterogeneous batch in which every request has
another deterministic policy. Each must give, bitwise, the tokens of the request decoded
alone by the reference in this (default-threads) process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from prompt_sets import SPREAD8 as PICKS

POLICIES = ("reference", "batch-invariant", "margin", "verify-all", "dvr")
NEW_TOKENS = 32

SCRIPT = """
import json, sys
from margingate.data.prompts import builtin_prompts
from margingate.llm import LLM

threads, policies, picks, n = int(sys.argv[1]), sys.argv[2].split(","), json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(max_batch_size=len(picks), num_threads=threads, prefill_chunk=16)
prompts = [builtin_prompts()[i] for i in picks]
reqs = llm.requests(prompts, max_new_tokens=n, ignore_eos=True)
for k, r in enumerate(reqs):
    r.policy = llm.policy(policies[k % len(policies)])
print(json.dumps({"threads": llm.engine.num_threads, "tokens": [r.token_ids for r in llm.engine.generate(reqs)]}))
"""


def decode_in_fresh_process(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(threads), ",".join(POLICIES), json.dumps(PICKS),
                          str(NEW_TOKENS)], capture_output=True, text=True, env=env, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def alone(references):
    return references.tokens(PICKS, NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_same_tokens_at_any_thread_count(threads, alone):
    run = decode_in_fresh_process(threads)
    assert run["threads"] == threads
    for k, (got, want) in enumerate(zip(run["tokens"], alone)):
        assert got == want, f"request {k} ({POLICIES[k % len(POLICIES)]}) at {threads} threads"
