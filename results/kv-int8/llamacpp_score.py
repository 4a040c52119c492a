"""Runs inside llama.cpp's own venv: `python llamacpp_score.py JOB RESULT`.

JOB (JSON): gguf, token ids, threads, type_k (ggml type of the K and V cache: 1 F16, 8 Q8_0, 2 Q4_0). The tokens
are fed in llama.cpp's own n_batch chunks with every row's logits kept; flash attention on (llama.cpp needs it for
a quantized V cache). RESULT: per position i >= 1, the log-probability of token i and the argmax after i - 1; and
the KV cache's own log lines about its Hadamard rotation (`attn_rot_k = 1`: K rotated; LLAMA_ATTN_ROT_DISABLE=1 in
the environment turns it off).
"""
import ctypes
import json
import sys

import llama_cpp as lc
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/margingate/peers")
from llamacpp_worker import _log  # noqa: E402

ROTATION_LINES: list[str] = []


@lc.llama_log_callback
def _log_rotation(level, text, user):  # the cache's rotation lines kept; the rest as the worker's callback
    line = text.decode(errors="replace")
    if "attn_rot" in line or "rotation" in line:
        ROTATION_LINES.append(line.strip())
    _log(level, text, user)


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    ids = job["ids"]
    lc.llama_log_set(_log_rotation, None)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(job["gguf"].encode(), lc.llama_model_default_params())
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    p = lc.llama_context_default_params()
    p.n_ctx = -(-(len(ids) + 1) // 256) * 256
    p.n_threads = p.n_threads_batch = job["threads"]
    p.flash_attn_type = 1
    p.type_k = p.type_v = job["type_k"]
    ctx = lc.llama_init_from_model(model, p)
    batch = lc.llama_batch_init(p.n_batch, 0, 1)
    logprobs, argmax = [], []
    for s in range(0, len(ids), p.n_batch):
        chunk = ids[s:s + p.n_batch]
        for i, tok in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, s + i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(chunk)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        ptr = ctypes.cast(lc.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float))
        rows = np.ctypeslib.as_array(ptr, shape=(len(chunk), n_vocab)).astype(np.float64)
        top = rows.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        for i in range(len(chunk)):
            nxt = s + i + 1
            if nxt < len(ids):
                logprobs.append(float(rows[i, ids[nxt]] - lse[i]))
                argmax.append(int(rows[i].argmax()))
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    with open(result_path, "w") as f:
        json.dump({"logprobs": logprobs, "argmax": argmax, "type_k": p.type_k, "version": lc.__version__,
                   "rotation": ROTATION_LINES}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
