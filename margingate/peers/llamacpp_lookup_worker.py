"""Runs inside llama.cpp's own venv (llama-cpp-python and numpy only):
`python llamacpp_lookup_worker.py JOB RESULT`, for `margingate bench-spec --peers llamacpp`.

llama.cpp's prompt-lookup decoding as llama-cpp-python users run it: `Llama(draft_model=
LlamaPromptLookupDecoding(num_pred_tokens=k))` and `Llama.generate`, which feeds [last token,
drafts] in one `llama_decode` with logits for every row and keeps drafts while they equal the
sampled token. Plain decoding is the same `Llama.generate` without a draft model.

JOB (JSON): gguf, threads, prompt_ids, max_new_tokens, k (list), repeats.
RESULT (JSON): per prompt and config ("plain" or k) the median wall seconds of `max_new_tokens`
greedy tokens (prefill included, as bench-spec times our engine) and the tokens; the version.
Each prompt runs alone (B = 1) from an empty KV cache; EOS does not stop it.
"""
import json
import statistics
import sys
import time

import llama_cpp as lc
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def decode(llm: lc.Llama, ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `ids` (temp 0 is llama.cpp's greedy sampler)."""
    llm.reset()
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    ids, n = job["prompt_ids"], job["max_new_tokens"]
    context = -(-(max(map(len, ids)) + n + max(job["k"]) + 1) // 256) * 256
    rows = []
    for k in [0, *job["k"]]:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
        llm = lc.Llama(model_path=job["gguf"], n_ctx=context, n_threads=job["threads"],
                       n_threads_batch=job["threads"], draft_model=draft, verbose=False)
        decode(llm, ids[0], 4)  # warm-up
        for i, prompt in enumerate(ids):
            seconds = []
            for _ in range(job["repeats"]):
                t = time.perf_counter()
                tokens = decode(llm, prompt, n)
                seconds.append(time.perf_counter() - t)
            rows.append({"prompt": i, "k": k, "seconds": statistics.median(seconds), "tokens": tokens})
        llm.close()
    with open(result_path, "w") as f:
        json.dump({"rows": rows, "version": lc.__version__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
