#!/bin/bash
# Resident memory and decode speed at B = 16 on the 1B Q4_K_M (llama.cpp's own quantization of
# scripts/make_random_model.py --size 1b), ours beside llama.cpp in one bench run, every contender at the same
# thread count; then B = 16 on the embedded model at short context (decode speed, against the report kept
# from before the paged cache: results/bench). Needs make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/kv-memory
M=$MARGINGATE_CACHE/random-1b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 1b --out "$M"
Q=$MARGINGATE_CACHE/random-1b.q4_k_m.gguf
if [ ! -f "$Q" ]; then
  BF16=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
  .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16" "$Q" q4_k_m
fi
A=(--batch-sizes 16 --limit 16 --max-new-tokens 32 --repeats 1 --warmup 1 --no-pass-profile --threads 2)
.venv/bin/margingate bench --model "$Q" "${A[@]}" --policies fast,batch-invariant --peers llamacpp --out $O/1b-q4_k_m-b16
.venv/bin/margingate bench "${A[@]}" --policies fast,batch-invariant,margin --out $O/smollm2-b16
