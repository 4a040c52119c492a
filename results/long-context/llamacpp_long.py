"""Runs inside llama.cpp's own venv: `python llamacpp_long.py JOB RESULT`.

JOB (JSON): gguf, prompt token ids, new (decode steps), threads, flash_attn (true/false), type_k (ggml type
number of the K and V cache: 1 F16, 8 Q8_0). The prompt is prefilled in one llama_decode per n_batch rows
(llama.cpp's own chunking, n_batch = n_ubatch = 512 as its default), then `new` greedy steps of one row, the
first of them not timed.
RESULT: prefill seconds, decode seconds, the greedy tokens, resident memory, the context's settings.
"""
import ctypes
import json
import sys
import time

import llama_cpp as lc
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/margingate/peers")
from llamacpp_worker import _log, rss_mb  # noqa: E402  (the bench's worker: its log filter and RSS)


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    ids, new = job["prompt_ids"], job["new"]
    lc.llama_log_set(_log, None)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(job["gguf"].encode(), lc.llama_model_default_params())
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    p = lc.llama_context_default_params()
    p.n_ctx = -(-(len(ids) + new + 1) // 256) * 256
    p.n_threads = p.n_threads_batch = job["threads"]
    p.flash_attn_type = 1 if job["flash_attn"] else 0
    p.type_k = p.type_v = job.get("type_k", 1)
    ctx = lc.llama_init_from_model(model, p)
    batch = lc.llama_batch_init(p.n_batch, 0, 1)

    def decode(rows):  # (token, pos, wants logits); the last row's logits if it wants them, else None
        for i, (tok, pos, out) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(rows)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        if not rows[-1][2]:
            return None
        ptr = ctypes.cast(lc.llama_get_logits_ith(ctx, -1), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()

    t = time.perf_counter()
    for s in range(0, len(ids), p.n_batch):
        chunk = ids[s:s + p.n_batch]
        logits = decode([(tok, s + i, s + i == len(ids) - 1) for i, tok in enumerate(chunk)])
    prefill = time.perf_counter() - t
    out = [int(logits.argmax())]
    for step in range(1, new):
        if step == 2:  # the first decode step is not timed (nor is ours)
            t = time.perf_counter()
        out.append(int(decode([(out[-1], len(ids) + step - 1, True)]).argmax()))
    seconds = time.perf_counter() - t
    result = {"prefill_s": prefill, "decode_s": seconds, "decode_steps": new - 2, "tokens": out,
              "rss_mb": rss_mb(), "n_ctx": p.n_ctx, "n_batch": p.n_batch, "flash_attn": job["flash_attn"],
              "type_k": p.type_k, "version": lc.__version__}
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
