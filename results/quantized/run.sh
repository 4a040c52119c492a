#!/bin/bash
# The `--weights exact` figures (docs/quantized.md): GGUF files kept quantized under the bf16-bits contract
# against llama.cpp on exactly the same files, decode-only beside end to end, resident memory; every
# contender at all cores. The 1B and 8B files are llama.cpp's own quantizations (scripts/quantize_gguf.py)
# of the BF16 export of scripts/make_random_model.py. Needs make llamacpp-venv; the 8B needs ~15 GB of disk
# for its bf16 source. Then the 1B Q4_K_M kept quantized against dequantized: q4km_digest.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/quantized
for size in 1b 8b; do
  M=$MARGINGATE_CACHE/random-$size
  [ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size $size --out "$M"
  BF16=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
  for q in q4_k_m q8_0; do
    [ "$size/$q" = 8b/q8_0 ] && continue
    [ -f "$MARGINGATE_CACHE/random-$size.$q.gguf" ] || \
      .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16" "$MARGINGATE_CACHE/random-$size.$q.gguf" $q
  done
done
A=(--weights exact --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only
   --no-pass-profile)
B1=(--batch-sizes 1 "${A[@]}")
B16=(--batch-sizes 16 --limit 16 "${A[@]}")
.venv/bin/margingate bench "${B1[@]}" --limit 4 --max-new-tokens 32 --out $O/smollm2-q4_1-b1
for q in q4_k_m q8_0; do
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" "${B1[@]}" --limit 4 \
    --max-new-tokens 32 --out $O/1b-$q-b1
  .venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-1b.$q.gguf" "${B16[@]}" --max-new-tokens 32 \
    --out $O/1b-$q-b16
done
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" "${B1[@]}" --limit 2 \
  --max-new-tokens 16 --out $O/8b-q4_k_m-b1
.venv/bin/margingate bench --model "$MARGINGATE_CACHE/random-8b.q4_k_m.gguf" "${B16[@]}" --max-new-tokens 16 \
  --out $O/8b-q4_k_m-b16
.venv/bin/python $O/q4km_digest.py "$MARGINGATE_CACHE/random-1b.q4_k_m.gguf" > $O/q4km_digest.txt
