#!/bin/bash
# The quantized B = 16 rows re-run on kernels v10 (they dated from v7 and v8): llama.cpp's own Q4_K_M and
# Q8_0 files of the 1B and the 8B Q4_K_M, ours (fast, batch-invariant) against llama.cpp on the same file,
# decode-only beside end-to-end, at all cores (2 here), one contender after another. The files: see
# results/quantized/run.sh. Needs make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/bench-v11
B16=(--batch-sizes 16 --limit 16 --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp
     --decode-only --no-pass-profile)
for q in q4_k_m q8_0; do
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" "${B16[@]}" --max-new-tokens 32 \
    --out $O/1b-$q-b16
done
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" "${B16[@]}" --max-new-tokens 16 \
  --out $O/8b-q4_k_m-b16
