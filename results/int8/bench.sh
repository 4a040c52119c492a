#!/bin/bash
# Issue 45's speed figures: quantized files under the integer-exact contract (--weights auto) against
# llama.cpp on exactly the same files, every contender at the same thread count (all cores), one command
# per figure, decode-only tok/s beside end to end, resident memory and the machine's read bandwidth (the
# roofline in each report). The 1B files are llama.cpp's own quantizations (scripts/quantize_gguf.py) of
# the BF16 export of scripts/make_random_model.py --size 1b. Needs make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=${1:-results/int8/bench}  # the output folder (one per machine kind: its CPU is in each report)
M=$MARGINGATE_CACHE/random-1b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 1b --out "$M"
BF16=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
for q in q4_k_m q8_0 q4_0 q6_k; do
  [ -f "$MARGINGATE_CACHE/random-1b.$q.gguf" ] || \
    .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16" "$MARGINGATE_CACHE/random-1b.$q.gguf" $q
done
ARGS=(--repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only --no-pass-profile)
for q in q4_k_m q8_0 q4_0 q6_k; do
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" --batch-sizes 1 --limit 4 \
    --max-new-tokens 32 "${ARGS[@]}" --out $O/1b-$q-b1
done
for q in q4_k_m q8_0; do
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" --batch-sizes 16 --limit 16 \
    --max-new-tokens 32 "${ARGS[@]}" --out $O/1b-$q-b16
done
.venv/bin/margingate bench --batch-sizes 1,16 --limit 16 --max-new-tokens 32 "${ARGS[@]}" --out $O/smollm2-q4_1
