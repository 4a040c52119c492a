#!/bin/bash
# Decode at B = 4 and 6 on the 1B Q4_K_M beside llama.cpp on the same file, every contender at the same threads:
# the row tiles of 4 to 6 rows of the int8 VNNI kernel. Under the measurement lock, `uptime` in the report.
#   bash results/roofline/small_batch.sh [Q4_K_M.gguf] [out folder]
set -euo pipefail
cd "$(dirname "$0")/../.."
Q4=${1:-/tmp/mg-start/random-1b.q4_k_m.gguf}
O=${2:-results/roofline/1b-q4_k_m-b4-b6}
MARGINGATE_LLAMACPP_PYTHON=${MARGINGATE_LLAMACPP_PYTHON:-.venv-llamacpp/bin/python} flock /tmp/mg-measure.lock \
  .venv/bin/margingate bench --model "$Q4" --batch-sizes 4,6 --limit 6 --max-new-tokens 32 --repeats 3 --warmup 1 \
  --policies fast,batch-invariant --peers llamacpp --decode-only --no-pass-profile --no-step-profile --out "$O"
