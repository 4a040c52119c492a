#!/bin/bash
# Issue 45's determinism checks under the integer-exact contract (--weights auto, the default): reference,
# batch-invariant, margin and dvr, at default threads and --threads 1, on the embedded SmolLM2 Q4_1 file
# (hetero and staggered batches of 4 and 16, 16 prompts x 128 tokens) and on llama.cpp's own 1B Q4_K_M
# quantization (8 prompts x 32 tokens, batches of 4 and 8: a 1B model on 2 cores). Each run prints its
# token digest and its sequence determinism; the same digest across policies and thread counts is the claim.
set -euo pipefail
cd "$(dirname "$0")/../.."
O=results/int8/check
source results/check/run_check.sh
for p in reference batch-invariant margin dvr; do
  run smollm2-$p --policy $p
  run smollm2-$p-t1 --policy $p --threads 1
done
Q4KM="$MARGINGATE_CACHE/random-1b.q4_k_m.gguf"  # results/int8/bench.sh makes it
for p in reference batch-invariant margin dvr; do
  run 1b-q4_k_m-$p --model "$Q4KM" --policy $p --limit 8 --max-new-tokens 32 --batch-sizes 4,8
  run 1b-q4_k_m-$p-t1 --model "$Q4KM" --policy $p --limit 8 --max-new-tokens 32 --batch-sizes 4,8 --threads 1
done
run smollm2-fast --policy fast  # the inverse control: must flip
