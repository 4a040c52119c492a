"""Runs inside llama.cpp's own venv (llama-cpp-python, numpy and the standard library only):
`python llamacpp_worker.py JOB RESULT`.

JOB (JSON): the GGUF path, prompt token ids, max_new_tokens, batch_size, repeats, warmup, threads.
RESULT (JSON): wall seconds of each timed run of all prompts, their outputs, each prompt's output
decoded alone (a batch of one), the llama-cpp-python version and the context's settings. A JOB with
`continuations` (token ids per prompt) asks instead for the logprob of each of their tokens.

Decoding goes through llama.cpp's low-level API (`llama_batch_init`, `llama_decode`), one sequence
id per request, each with its own KV (n_seq_max = B, n_ctx = B x the longest prompt + output,
rounded up to 256): static batches, like the HF peer. Prompts run in groups of B; a group's prompts
are prefilled in one `llama_decode`, then each step decodes one token of every sequence of the
group in one `llama_decode`. Every request arrives at once and decodes exactly max_new_tokens, so
continuous batching with B slots would schedule the same groups. Our token ids are fed as they are
(nothing is tokenized here); the next token is the argmax of its logits, ties to the lowest id (like
torch's argmax); EOS is ignored. Everything else is llama.cpp's default (F16 KV cache, flash
attention on auto), as a user would run it; n_threads and n_threads_batch are the bench's count.
"""
import ctypes
import json
import sys
import time

import llama_cpp as lc
import numpy as np

GGML_LOG_LEVEL_WARN = 3


@lc.llama_log_callback
def _log(level, text, _user):  # llama.cpp's INFO chatter off; warnings and errors to stderr
    if level in (GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_WARN + 1):
        sys.stderr.write(text.decode(errors="replace"))


class Decoder:
    def __init__(self, gguf: str, batch_size: int, context: int, prefill: int, threads: int):
        lc.llama_log_set(_log, None)
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(gguf.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        per_seq = -(-context // 256) * 256
        p = lc.llama_context_default_params()
        p.n_seq_max, p.n_ctx = batch_size, batch_size * per_seq
        p.n_batch = max(p.n_batch, prefill)  # a group's prompts in one llama_decode
        p.n_threads = p.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.settings = {"n_ctx": p.n_ctx, "n_seq_max": p.n_seq_max, "n_batch": p.n_batch, "n_ubatch": p.n_ubatch,
                         "n_threads": p.n_threads, "n_threads_batch": p.n_threads_batch, "type_k": p.type_k,
                         "type_v": p.type_v, "flash_attn_type": p.flash_attn_type, "kv_unified": p.kv_unified,
                         "system_info": lc.llama_print_system_info().decode().strip()}
        self.capacity = max(p.n_batch, batch_size)
        self.batch = lc.llama_batch_init(self.capacity, 0, 1)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode of (token, position, sequence, wants logits) rows; the argmax of each
        row that wants logits, in order."""
        return self._logits(tokens).argmax(axis=1)  # the first maximum: ties go to the lowest id

    def _logits(self, tokens: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """One llama_decode; the logits of each row that wants them, in order ([rows, vocab] fp32)."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(out for *_, out in tokens)
        ptr = ctypes.cast(lc.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)).copy()

    def score(self, prompt: list[int], continuation: list[int]) -> list[float]:
        """The logprob of each continuation token after the prompt (one llama_decode, every row's logits)."""
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        seq = prompt + continuation
        rows = [(tok, pos, 0, pos >= len(prompt) - 1) for pos, tok in enumerate(seq[:-1])]
        logits = self._logits(rows).astype(np.float64)
        top = logits.max(axis=1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        return [float(logits[i, t] - logz[i]) for i, t in enumerate(continuation)]

    def group(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Exactly `n` greedy tokens after each prompt, all decoded together (sequence s = prompts[s])."""
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        rows = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        if len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} prompt tokens exceed the batch of {self.capacity}")
        nxt = self._decode(rows)
        outs = [[int(t)] for t in nxt]
        for step in range(1, n):
            nxt = self._decode([(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs))])
            for o, t in zip(outs, nxt):
                o.append(int(t))
        return outs

    def run(self, prompts: list[list[int]], n: int, batch_size: int) -> list[list[int]]:
        return [o for i in range(0, len(prompts), batch_size) for o in self.group(prompts[i:i + batch_size], n)]

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)
        lc.llama_backend_free()


def rss_mb() -> float:
    """Resident memory now (VmRSS), MB: the model and its KV cache after the runs."""
    return int(next(s for s in open("/proc/self/status") if s.startswith("VmRSS:")).split()[1]) / 1024


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    ids, n, b = job["prompt_ids"], job["max_new_tokens"], job["batch_size"]
    longest = max(map(len, ids))
    prefill = b * (longest + n if "continuations" in job else longest)  # scoring decodes the continuation too
    dec = Decoder(job["gguf"], b, context=longest + n + 1, prefill=prefill, threads=job["threads"])
    if "continuations" in job:  # scoring: the logprobs of given continuations, nothing timed
        scores = [dec.score(p, c) for p, c in zip(ids, job["continuations"])]
        dec.close()
        with open(result_path, "w") as f:
            json.dump({"logprobs": scores, "version": lc.__version__}, f)
        return
    for _ in range(job["warmup"]):
        dec.run(ids[:b], n, b)
    seconds, outputs = [], None
    for _ in range(job["repeats"]):
        t = time.perf_counter()
        outputs = dec.run(ids, n, b)
        seconds.append(time.perf_counter() - t)
    alone = [dec.group([p], n)[0] for p in ids]
    settings, rss = dec.settings, rss_mb()
    dec.close()
    with open(result_path, "w") as f:
        json.dump({"seconds": seconds, "outputs": outputs, "alone": alone, "version": lc.__version__,
                   "settings": settings, "rss_mb": rss}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
