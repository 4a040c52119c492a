#!/bin/bash
# Kernels v8's figures: the quantized linear at many rows dequantizing each k slice straight into L1.
# At all cores (2 here), every contender at the same thread count, one after another.
# Needs make vllm-venv and make llamacpp-venv, and results/quantized/run.sh's 1B Q4_K_M file.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/bench-v8
B16=(--batch-sizes 16 --limit 16 --repeats 2 --warmup 1 --policies fast,batch-invariant --decode-only --no-pass-profile)
# The embedded 135M at B = 16 against both peers: its Q4_1 file kept quantized (the default), then
# dequantized at load (--weights bf16: the bf16 weights vLLM runs; llama.cpp then runs their BF16 GGUF)
.venv/bin/margingate bench "${B16[@]}" --max-new-tokens 128 --peers vllm,llamacpp --out $O/smollm2-b16
.venv/bin/margingate bench "${B16[@]}" --max-new-tokens 128 --peers vllm,llamacpp --weights bf16 --out $O/smollm2-b16-bf16
# The 1B at Q4_K_M (llama.cpp's own quantizer) at B = 16 against llama.cpp on the same file
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.q4_k_m.gguf" "${B16[@]}" --max-new-tokens 32 \
  --peers llamacpp --out $O/1b-q4_k_m-b16
