#!/bin/bash
# Issue 64's figures: llama.cpp's own Q3_K_M and IQ4_XS quantizations (scripts/quantize_gguf.py; neither needs
# an importance matrix) of the BF16 export of scripts/make_random_model.py --size 1b, kept quantized under the
# integer-exact contract (--weights auto) against llama.cpp on exactly the same files: B = 1 decode-only tok/s
# beside end to end and resident memory (margingate bench; every contender at the same thread count), then
# greedy agreement with the file's bf16 model (results/int8/quality.py), then each type's digest on each int8
# path (digests.py). Each timed run holds the measurement lock and records uptime before and after.
#   bash results/quantized/types/bench.sh   (PY, MG and LLAMA name the two environments' binaries; FILES the folder
#                                             of the GGUF files, MARGINGATE_CACHE's by default; TYPES the files
#                                             to time, "q3_k_m iq4_xs" by default)
#   TYPES="iq2_xxs iq3_xxs" bash results/quantized/types/bench.sh   the IQ grids: llama.cpp wants an importance
#   matrix for them, so scripts/quantize_iq_gguf.py makes them (its quantizer, a uniform importance matrix)
set -euo pipefail
cd "$(dirname "$0")/../../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}" PYTHONPATH=$PWD
PY=${PY:-.venv/bin/python} MG=${MG:-.venv/bin/margingate}
export MARGINGATE_LLAMACPP_PYTHON=${LLAMA:-.venv-llamacpp/bin/python}
O=results/quantized/types
F=${FILES:-$MARGINGATE_CACHE}
M=$MARGINGATE_CACHE/random-1b
BF16=$F/random-1b.bf16.gguf
if [ ! -f "$BF16" ]; then
  [ -f "$M/config.json" ] || $PY scripts/make_random_model.py --size 1b --out "$M"
  BF16=$($PY -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
fi
TYPES=${TYPES:-q3_k_m iq4_xs}
for q in $TYPES q2_k iq4_nl; do
  [ -f "$F/random-1b.$q.gguf" ] && continue
  case $q in
    iq1_* | iq2_* | iq3_*) $PY scripts/quantize_iq_gguf.py "$BF16" "$F/random-1b.$q.gguf" $q ;;
    *) "$MARGINGATE_LLAMACPP_PYTHON" scripts/quantize_gguf.py "$BF16" "$F/random-1b.$q.gguf" $q ;;
  esac
done
ARGS=(--repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only --no-pass-profile)
for q in $TYPES; do
  uptime
  flock /tmp/mg-measure.lock $MG bench --model "$F/random-1b.$q.gguf" --batch-sizes 1 --limit 4 \
    --max-new-tokens 32 "${ARGS[@]}" --out $O/1b-$q-b1
  uptime
done
for q in $TYPES; do
  $PY results/int8/quality.py --model "$F/random-1b.$q.gguf" --prompts 8 --tokens 32 \
    --out $O/quality-$q.json
done
$PY $O/digests.py | tee $O/digests.md
