"""The work the engine does under pressure, without HTTP and at 1 thread (CPU seconds and rows do not depend on
what else the machine runs, where wall time does): N distinct ~1,400-token prompts, 24 new tokens each, margin,
batch-invariant, dvr and fast in turn, a 0.25 GB pool, the prefix cache on as `serve` runs it.

    PYTHONPATH=. .venv/bin/python results/pressure/engine_work.py 16        # this branch
    PYTHONPATH=/path/to/main .venv/bin/python results/pressure/engine_work.py 16   # main's code
"""
import random
import resource
import sys
import time

from margingate.engine import Request
from margingate.llm import LLM
from margingate.options import SamplingParams

N = int(sys.argv[1])
llm = LLM(max_num_seqs=64, kv_cache_memory=0.25, prefix_cache_tokens=16384, num_threads=1, max_model_len=4096)
words = ("the system stores each record in a ledger and every clerk checks the totals before the office closes "
         "while engineers measure latency under load").split()
policies = ["margin", "batch-invariant", "dvr", "fast"]
reqs = []
for i in range(N):
    rng = random.Random(i)
    ids = llm.tokenizer.encode(f"Document {i}. " + " ".join(rng.choice(words) for _ in range(1820)))[:1400]
    reqs.append(Request(ids, 24, llm.policy(policies[i % 4]), ignore_eos=True, request_id=f"r{i}",
                        sampling=SamplingParams(logprobs=1)))
c0, t = resource.getrusage(resource.RUSAGE_SELF), time.time()
llm.engine.generate(reqs)
c1, e = resource.getrusage(resource.RUSAGE_SELF), llm.engine
print("N", N, "wall", round(time.time() - t, 1), "cpu", round(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime, 1),
      "preemptions", e.load.preemptions, "steps", e.step_count,
      {k: (v.calls, v.rows, round(v.seconds, 1)) for k, v in e.totals.items()}, "prefix", e.prefix.stats, flush=True)
