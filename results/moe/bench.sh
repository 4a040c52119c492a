#!/bin/bash
# Issue 46's speed figures: a Qwen3-MoE (scripts/make_random_model.py --size moe-a1b: Qwen3-30B-A3B's hidden
# size, heads, expert width and top-8, 16 layers of 64 experts) and a Qwen3 dense model at Qwen3-1.7B's shape,
# each as llama.cpp's own Q4_K_M of our BF16 export (scripts/quantize_gguf.py); ours (fast, batch-invariant)
# against llama.cpp on the same file, decode-only tok/s, every contender at the same thread count (all cores),
# resident memory in each report. Needs make llamacpp-venv.
#   bash results/moe/bench.sh [OUT]   # default results/moe/bench
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=${1:-results/moe/bench}
for size in moe-a1b qwen3-1.7b; do
  M=$MARGINGATE_CACHE/random-$size
  [ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size $size --out "$M"
  BF16=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
  [ -f "$MARGINGATE_CACHE/random-$size.q4_k_m.gguf" ] || \
    .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16" "$MARGINGATE_CACHE/random-$size.q4_k_m.gguf" q4_k_m
done
ARGS=(--repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only --no-pass-profile
      --max-new-tokens 32)
for size in moe-a1b qwen3-1.7b; do
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-$size.q4_k_m.gguf" --batch-sizes 1 --limit 4 \
    "${ARGS[@]}" --out $O/$size-q4_k_m-b1
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-$size.q4_k_m.gguf" --batch-sizes 16 --limit 16 \
    "${ARGS[@]}" --out $O/$size-q4_k_m-b16
done
