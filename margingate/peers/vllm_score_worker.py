"""Runs inside vLLM's own venv (vLLM and the standard library only): `python vllm_score_worker.py JOB RESULT`.

JOB (JSON): model folder, prompt token ids, batch_size, repeats, warmup, alone (how many prompts to
also score alone). Each timed run scores every prompt (`prompt_logprobs=0`, one new token) with
max_num_seqs = batch_size. RESULT (JSON): the runs' wall seconds, each prompt token's logprob from
the last run, the first `alone` prompts' logprobs scored one at a time, and the vLLM version.
"""
import json
import os
import sys
import time


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    import vllm
    from vllm import LLM, SamplingParams

    ids = job["prompt_ids"]
    llm = LLM(model=job["model"], dtype="bfloat16", max_num_seqs=job["batch_size"],
              max_model_len=max(512, max(map(len, ids)) + 8), seed=0, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def score(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [[None] + [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, batch)]

    for _ in range(job["warmup"]):
        score(ids[: job["batch_size"]])
    seconds, logprobs = [], None
    for _ in range(job["repeats"]):
        t = time.perf_counter()
        logprobs = score(ids)
        seconds.append(time.perf_counter() - t)
    alone = [score([p])[0] for p in ids[: job["alone"]]]
    with open(result_path, "w") as f:
        json.dump({"seconds": seconds, "logprobs": logprobs, "alone": alone, "version": vllm.__version__}, f)
    llm.llm_engine.engine_core.shutdown()  # its processes end now, not in a teardown that may abort


if __name__ == "__main__":
    main(*sys.argv[1:3])
    sys.stdout.flush()
    os._exit(0)  # the engine is shut down: skip the interpreter teardown, which can abort (SIGABRT)
