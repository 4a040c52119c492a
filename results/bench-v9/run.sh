#!/bin/bash
# Kernels v9's figures (issues 32 and 33), at all cores (2 here), every contender at the same thread
# count, one command per figure: the 1B random model at B = 16 against vLLM and llama.cpp (decode-only
# beside end to end); the embedded 135M at B = 16, kept quantized (the default) and on bf16 weights,
# against both peers. Needs make vllm-venv and make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/bench-v9
M=$MARGINGATE_CACHE/random-1b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 1b --out "$M"
.venv/bin/margingate bench --model "$M" --batch-sizes 16 --limit 16 --max-new-tokens 32 --repeats 1 --warmup 1 \
  --policies fast,batch-invariant --peers vllm,llamacpp --decode-only --out $O/decode-1b
B16=(--batch-sizes 16 --limit 16 --repeats 2 --warmup 1 --policies fast,batch-invariant --decode-only --no-pass-profile)
.venv/bin/margingate bench "${B16[@]}" --max-new-tokens 128 --peers vllm,llamacpp --out $O/smollm2-b16
.venv/bin/margingate bench "${B16[@]}" --max-new-tokens 128 --peers vllm,llamacpp --weights bf16 --out $O/smollm2-b16-bf16
