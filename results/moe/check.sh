#!/bin/bash
# Issue 46's determinism check on a mixture of experts: a random-weight Qwen3-MoE (scripts/make_random_model.py
# --size moe-tiny: 2 layers of 8 experts, top-2, the embedded model's tokenizer), every deterministic policy at
# default threads and reference and batch-invariant at --threads 1, one token digest; `fast` the inverse control.
set -euo pipefail
cd "$(dirname "$0")/../.."
O=${1:-results/moe/check}
source results/check/run_check.sh
M=$MARGINGATE_CACHE/random-moe-tiny
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size moe-tiny --out "$M"
A=(--model "$M" --max-new-tokens 64)
for p in reference batch-invariant margin dvr; do run moe-tiny-$p --policy $p "${A[@]}"; done
for p in reference batch-invariant; do run moe-tiny-$p-t1 --policy $p --threads 1 "${A[@]}"; done
run moe-tiny-fast --policy fast "${A[@]}"
