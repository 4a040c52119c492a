"""Runs inside vLLM's own venv (vLLM and the standard library only): `python vllm_worker.py JOB RESULT`.

JOB (JSON): model folder, prompt token ids, max_new_tokens, batch_size, repeats, warmup.
RESULT (JSON): wall seconds of each timed run of all prompts with max_num_seqs = batch_size, their
outputs, each prompt's output decoded alone (one request in flight), and the vLLM version.
"""
import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    import vllm
    from vllm import LLM, SamplingParams

    ids, n = job["prompt_ids"], job["max_new_tokens"]
    # No prefix caching: the warm-up and every repeat send the same prompts, and a cache hit would skip
    # the prefill every other contender computes (margingate's bench engine runs without its prefix cache).
    llm = LLM(model=job["model"], dtype="bfloat16", max_num_seqs=job["batch_size"],
              max_model_len=max(512, max(map(len, ids)) + n + 8), seed=0, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ids]

    def run(batch):
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]

    for _ in range(job["warmup"]):
        run(prompts[: job["batch_size"]])
    seconds, outputs = [], None
    for _ in range(job["repeats"]):
        t = time.perf_counter()
        outputs = run(prompts)
        seconds.append(time.perf_counter() - t)
    alone = [run([p])[0] for p in prompts]
    with open(result_path, "w") as f:
        json.dump({"seconds": seconds, "outputs": outputs, "alone": alone, "version": vllm.__version__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
