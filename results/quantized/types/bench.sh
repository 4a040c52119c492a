#!/bin/bash
# Issue 64's figures: llama.cpp's own quantizations (scripts/quantize_gguf.py; none of these types needs an
# importance matrix) of the BF16 export of scripts/make_random_model.py --size 1b, kept quantized under the
# integer-exact contract (--weights auto) against llama.cpp on exactly the same files. Q3_K_M and IQ4_XS (the
# issue's targets), and one file of each other type for the per-type table's B = 1 column: B = 1 decode-only
# tok/s beside end to end (margingate bench; every contender at the same thread count, 3 timed runs each). Then,
# on Q3_K_M and IQ4_XS: resident memory, each contender in a fresh process doing the same decode (memory.py:
# steady and peak, anonymous and file pages; ours on a first load and a later one), and greedy agreement with the
# bf16 model (results/int8/quality.py: the file's own dequantization, and the BF16 export it was quantized
# from). Then each type's digest on each int8 path (digests.py) and the per-type table (table.py). Each timed
# run holds the measurement lock and records uptime before and after.
#   bash results/quantized/types/bench.sh   (PY, MG and LLAMA name the two environments' binaries; FILES the folder
#                                             of the GGUF files, MARGINGATE_CACHE's by default; TYPES the files
#                                             to time, every type of the table by default)
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
# one file per type of the table (table.py); MXFP4's figure is gpt-oss's (results/gpt-oss/bench.sh)
FILES_B1=${TYPES:-q3_k_m iq4_xs q2_k iq4_nl q4_0 q4_1 q5_0 q5_1 q4_k_m q5_k_m q6_k q8_0 iq3_xxs iq3_s iq2_xxs iq2_xs iq2_s iq1_s iq1_m}
for q in $FILES_B1; do
  [ -f "$F/random-1b.$q.gguf" ] && continue
  case $q in
    iq1_* | iq2_* | iq3_*) $PY scripts/quantize_iq_gguf.py "$BF16" "$F/random-1b.$q.gguf" $q ;;
    *) "$MARGINGATE_LLAMACPP_PYTHON" scripts/quantize_gguf.py "$BF16" "$F/random-1b.$q.gguf" $q ;;
  esac
done
ARGS=(--policies batch-invariant --peers llamacpp --decode-only --no-pass-profile --batch-sizes 1)
for q in $FILES_B1; do
  case $q in  # llama.cpp decodes the IQ1/IQ2/IQ3 grids at 1-3 tokens/s here: one shorter run each
    iq1_* | iq2_* | iq3_*) RUN=(--repeats 1 --warmup 1 --limit 2 --max-new-tokens 16) ;;
    *) RUN=(--repeats 3 --warmup 1 --limit 4 --max-new-tokens 32) ;;
  esac
  uptime
  flock /tmp/mg-measure.lock $MG bench --model "$F/random-1b.$q.gguf" "${RUN[@]}" "${ARGS[@]}" --out $O/1b-$q-b1
  uptime
done
uptime
flock /tmp/mg-measure.lock $PY $O/memory.py "$F/random-1b.q3_k_m.gguf" "$F/random-1b.iq4_xs.gguf"
uptime
REF=${REFERENCE:-$M}  # the bf16 model the files were quantized from (a folder, or the BF16 GGUF)
[ -f "$REF/config.json" ] || REF=$BF16
for q in q3_k_m iq4_xs; do
  $PY results/int8/quality.py --model "$F/random-1b.$q.gguf" --prompts 12 --tokens 48 \
    --out $O/quality-$q.json
  $PY results/int8/quality.py --model "$F/random-1b.$q.gguf" --reference "$REF" --prompts 12 --tokens 48 \
    --out $O/quality-$q-vs-bf16.json
done
$PY $O/digests.py | tee $O/digests.md
$PY $O/table.py  # types.md and types.json: the per-type table from the digests and the B = 1 runs
