#!/bin/bash
# The 8B random-weight Llama (Llama 3 8B's shape, ~15 GB of bf16): load within 24 GB (memory-mapped
# safetensors, every matrix packed as soon as it is fused) and decode at B = 1 against the bandwidth floor.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
M=$MARGINGATE_CACHE/random-8b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 8b --out "$M"
.venv/bin/python - "$M" <<'PY' | tee results/bench-8b/report.txt
import json, sys, time
import torch
from margingate.analysis.roofline import measure
from margingate.data.prompts import builtin_prompts
from margingate.kernels.invariant import linear_path
from margingate.llm import LLM

def memory():  # GiB: peak resident, anonymous (our packed weights) and file-backed (mapped safetensors)
    keys = ("VmHWM", "RssAnon", "RssFile")
    return {k: int(l.split()[1]) / 2**20 for l in open("/proc/self/status") for k in keys if l.startswith(k + ":")}

t = time.perf_counter()
llm = LLM(model=sys.argv[1], max_num_seqs=1, max_model_len=256)
load_s, mem = time.perf_counter() - t, memory()
policy, prompt = llm.policy("batch-invariant"), [builtin_prompts()[0]]
def run(n):
    t = time.perf_counter()
    out = llm.generate(prompt, max_new_tokens=n, policy=policy, ignore_eos=True)
    return time.perf_counter() - t, out[0].token_ids
run(1)  # warm-up
t1, _ = run(1)
t9, ids = run(9)
ms = (t9 - t1) / 8 * 1e3  # 8 decode steps, the prefill and first token subtracted
W = llm.model.packed_weights
weight_bytes = sum(t.numel() * t.element_size() for t in [W.lm_head.data] + [getattr(L, n).data for L in W.layers
                   for n in ("qkv", "o_proj", "gate_up", "down_proj")])
m = measure(torch.get_num_threads())
floor = weight_bytes / (m.read_gb_s * 1e9) * 1e3
report = {"model": sys.argv[1], "threads": torch.get_num_threads(), "linear_path": linear_path(), "load_s": load_s,
          "memory_gib_after_load": mem, "peak_gib": memory()["VmHWM"], "decode_ms_per_token": ms,
          "streamed_gb_per_token": weight_bytes / 1e9, "read_gb_s": m.read_gb_s, "floor_ms_per_token": floor,
          "of_floor": floor / ms, "tokens": ids}
print(json.dumps(report, indent=1))
json.dump(report, open("results/bench-8b/report.json", "w"), indent=1)
PY
