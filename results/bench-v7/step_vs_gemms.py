"""Issue 32, item 6: one B-row batched decode step (the model forward) against the same step's layer and head
GEMMs alone, in one process. Usage: python results/bench-v7/step_vs_gemms.py B CONTEXT REPEATS MODEL."""
import sys
import time

import torch

from margingate.kernels import invariant
from margingate.kernels.attention import AttentionPlan
from margingate.llm import LLM

B, ctx, reps = (int(a) for a in sys.argv[1:4])
llm = LLM(sys.argv[4], max_batch_size=64)
m, kv = llm.model, llm.engine.runner.kv
tok, pos = torch.randint(0, llm.config.vocab_size, (B,)), torch.full((B,), ctx)
slots, plan = torch.tensor([kv.allocate() for _ in range(B)]), AttentionPlan(batched=list(range(B)))
W = m.own_weights
mats = [w for L in W.layers for w in (L.qkv, L.o_proj, L.gate_up, L.down_proj)] + [W.lm_head]
xs = {w.k: torch.randn(B, w.k).bfloat16() for w in mats}


def timed(f):
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


step = timed(lambda: m.forward(tok, pos, slots, plan, kv, logits_rows=torch.arange(B)))
gemms = timed(lambda: [invariant.linear(xs[w.k], w) for w in mats])
print(f"B={B} context={ctx}: step {step * 1e3:.1f} ms, its GEMMs alone {gemms * 1e3:.1f} ms, ratio {step / gemms:.2f}")
