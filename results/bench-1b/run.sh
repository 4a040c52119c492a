#!/bin/bash
# The 1B random-weight Llama (scripts/make_random_model.py --size 1b) against vLLM and llama.cpp, at all
# cores: decode at B = 1 and 16 (16 built-in prompts x 32 tokens), then prefill of one 2047-token prompt
# (results/bench-1b/prompt_2048.jsonl, 1 new token). Needs make vllm-venv and make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
M=$MARGINGATE_CACHE/random-1b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 1b --out "$M"
.venv/bin/margingate bench --model "$M" --batch-sizes 1,16 --limit 16 --max-new-tokens 32 --repeats 1 --warmup 1 \
  --policies fast,batch-invariant --peers vllm,llamacpp --out results/bench-1b/decode
.venv/bin/margingate bench --model "$M" --prompts-file results/bench-1b/prompt_2048.jsonl --batch-sizes 1 \
  --max-new-tokens 1 --max-model-len 4096 --repeats 3 --warmup 1 --policies fast,batch-invariant \
  --peers vllm,llamacpp --no-pass-profile --out results/bench-1b/prefill
