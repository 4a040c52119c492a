#!/bin/bash
# Kernels v10's figures (issue 33): quantized files at B = 1 against llama.cpp on exactly the same files,
# after the AVX512-BF16 dequantizer's 4-bit lookup, one-FMA offsets and per-panel scale addressing. At all
# cores (2 here), every contender at the same thread count, one command per figure. The 1B and 8B files
# are llama.cpp's own quantizations (results/quantized/run.sh makes them). Needs make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/bench-v10
B1=(--batch-sizes 1 --max-new-tokens 32 --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp
    --decode-only --no-pass-profile)
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.q4_k_m.gguf" "${B1[@]}" --limit 4 --out $O/1b-q4_k_m-b1
.venv/bin/margingate bench "${B1[@]}" --limit 4 --out $O/smollm2-q4_1-b1
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.q8_0.gguf" "${B1[@]}" --limit 4 --out $O/1b-q8_0-b1
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" "${B1[@]/32/16}" --limit 2 --out $O/8b-q4_k_m-b1
# The 1B Q4_K_M kept quantized and dequantized give the same tokens (q4km_digest.txt)
.venv/bin/python results/bench-v8/q4km_digest.py "$MARGINGATE_CACHE/random-1b.q4_k_m.gguf" > $O/q4km_digest.txt
