"""Runs in llama.cpp's venv: `python llamacpp_score.py JOB RESULT`. JOB (JSON): gguf, threads, pairs
([prompt ids, continuation ids]). RESULT: per pair, per continuation token, [logprob of that token,
llama.cpp's top-1 id] from llama.cpp's logits over prompt + continuation in one evaluation."""
import json
import sys

import llama_cpp
import numpy as np

job = json.load(open(sys.argv[1]))
longest = max(len(p) + len(c) for p, c in job["pairs"])
llm = llama_cpp.Llama(job["gguf"], n_ctx=longest + 8, n_batch=longest + 8, logits_all=True, verbose=False,
                      n_threads=job["threads"], n_threads_batch=job["threads"])
out = []
for prompt, cont in job["pairs"]:
    llm.reset()
    llm.eval(prompt + cont)
    logits = np.asarray(llm.scores[len(prompt) - 1:len(prompt) + len(cont) - 1], dtype=np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    out.append([[float(logits[i, t] - lse[i]), int(logits[i].argmax())] for i, t in enumerate(cont)])
json.dump({"scores": out, "version": llama_cpp.__version__}, open(sys.argv[2], "w"))
