#!/bin/bash
# Issue 33's figures: GGUF files kept quantized against llama.cpp on exactly the same files, at all
# cores (2 here), every contender at the same thread count. The 1B files are made by llama.cpp's own
# quantizer from the BF16 GGUF export of scripts/make_random_model.py --size 1b.
# Needs make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
M=$MARGINGATE_CACHE/random-1b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 1b --out "$M"
BF16=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
for q in q4_k_m q8_0; do
  [ -f "$MARGINGATE_CACHE/random-1b.$q.gguf" ] || \
    .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16" "$MARGINGATE_CACHE/random-1b.$q.gguf" $q
done
# B = 1 (4 prompts, one at a time) and B = 16, decode-only beside end-to-end, resident memory
.venv/bin/margingate bench --batch-sizes 1,16 --limit 16 --max-new-tokens 32 --repeats 1 --warmup 1 \
  --policies fast,batch-invariant --peers llamacpp --decode-only --no-pass-profile --out results/quantized/smollm2-q4_1
for q in q4_k_m q8_0; do
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" --batch-sizes 1 --limit 4 \
    --max-new-tokens 32 --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only \
    --no-pass-profile --out results/quantized/1b-$q-b1
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" --batch-sizes 16 --limit 16 \
    --max-new-tokens 32 --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only \
    --no-pass-profile --out results/quantized/1b-$q-b16
done
# The 8B at Q4_K_M (llama.cpp's quantizer), read straight from the file: no bf16 conversion is written
M8=$MARGINGATE_CACHE/random-8b
if [ ! -f "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" ]; then
  [ -f "$M8/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 8b --out "$M8"
  BF16_8B=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M8'))")
  .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16_8B" "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" q4_k_m
fi
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" --batch-sizes 1 --limit 2 \
  --max-new-tokens 16 --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only \
  --no-pass-profile --out results/quantized/8b-q4_k_m-b1
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" --batch-sizes 16 --limit 16 \
  --max-new-tokens 16 --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only \
  --no-pass-profile --out results/quantized/8b-q4_k_m-b16
