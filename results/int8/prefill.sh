#!/bin/bash
# Issue 45's prefill figure: prompts of 512 tokens (the built-in prompts' text joined, repeated, and cut at 512
# tokens of the embedded tokenizer, sent as plain text), one new token each, B = 1, on llama.cpp's own 1B Q4_K_M and Q8_0 files (bench.sh makes
# them), against llama.cpp on the same files at the same thread count. The run's time is the prefill's.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=${1:-results/int8/prefill}
mkdir -p "$O"
.venv/bin/python - "$O/prompts.jsonl" <<'PY'
import json, sys
from transformers import AutoTokenizer
from margingate.data.prompts import builtin_prompts
from margingate.models.loader import resolve_model_dir
tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m", tensors=False))
text = " ".join(p.text or " ".join(m["content"] for m in p.messages) for p in builtin_prompts())
ids = tok(text)["input_ids"] * 4  # repeated where the prompts hold fewer than 4 x 512 tokens
with open(sys.argv[1], "w") as f:
    for i in range(4):
        f.write(json.dumps({"text": tok.decode(ids[i * 512:(i + 1) * 512])}) + "\n")
PY
for q in q4_k_m q8_0; do
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" --prompts-file "$O/prompts.jsonl" \
    --limit 4 --max-new-tokens 1 --batch-sizes 1 --repeats 1 --warmup 1 --policies fast,batch-invariant \
    --peers llamacpp --no-pass-profile --out "$O/1b-$q"
done
