#!/bin/bash
# Issue 45's determinism checks under the integer-exact contract (--weights auto, the default): one token
# digest across reference, batch-invariant, margin and dvr, at default threads and --threads 1. The embedded
# SmolLM2 Q4_1 file: hetero and staggered batches of 4 and 16, 16 prompts x 64 tokens; llama.cpp's own 1B
# Q4_K_M quantization (results/int8/bench.sh makes it): batches of 4 and 8, 8 prompts x 32 tokens (a 1B
# model on 2 cores). `fast` is the inverse control and must flip. Each run prints its digest and rate.
#   bash results/int8/check.sh [OUT]    (results/int8/check-intel-amx: the Intel Xeon with AMX's runs)
set -euo pipefail
cd "$(dirname "$0")/../.."
O=${1:-results/int8/check}  # the output folder (one per machine kind)
source results/check/run_check.sh
S=(--max-new-tokens 64)
for p in reference batch-invariant margin dvr; do run smollm2-$p --policy $p "${S[@]}"; done
for p in reference batch-invariant; do run smollm2-$p-t1 --policy $p --threads 1 "${S[@]}"; done
run smollm2-fast --policy fast "${S[@]}"
B=(--model "$MARGINGATE_CACHE/random-1b.q4_k_m.gguf" --limit 8 --max-new-tokens 32 --batch-sizes 4,8)
for p in reference batch-invariant margin dvr; do run 1b-q4_k_m-$p --policy $p "${B[@]}"; done
run 1b-q4_k_m-reference-t1 --policy reference --threads 1 "${B[@]}"
run 1b-q4_k_m-fast --policy fast "${B[@]}"
# each int8 path this CPU has, forced (on a CPU without one, its run fails and names why)
MARGINGATE_FORCE_INT8=int8-avx2 run smollm2-reference-int8-avx2 --policy reference "${S[@]}"
MARGINGATE_FORCE_INT8=int8-avx512vnni run 1b-q4_k_m-reference-int8-avx512vnni --policy reference "${B[@]}"
