#!/bin/bash
# gpt-oss at 20B's widths (hidden 2880, 64 / 8 heads of 64, 32 experts of 2880, top 4, window 128 on even layers,
# YaRN, biases, sinks; random weights, scripts/make_random_model.py --size gpt-oss-20b-w) at 2 of its 24 layers,
# as llama.cpp's own MXFP4_MOE of our BF16 export (MXFP4 experts, Q8_0 elsewhere; scripts/quantize_gguf.py): ours
# (fast, batch-invariant; the file kept quantized under the int8 contract) against llama.cpp on the same file,
# decode-only tok/s at B = 1 and B = 16, every contender at the same thread count (all cores). Needs the
# llama.cpp venv. Runs under the measurement lock, `uptime` before and after.
#   bash results/gpt-oss/bench.sh [OUT]   # default results/gpt-oss/bench
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=${1:-results/gpt-oss/bench}
M=$MARGINGATE_CACHE/random-gpt-oss-20b-w
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size gpt-oss-20b-w --layers 2 --out "$M"
BF16=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
Q=$MARGINGATE_CACHE/random-gpt-oss-20b-w.mxfp4_moe.gguf
[ -f "$Q" ] || .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16" "$Q" mxfp4_moe
ARGS=(--repeats 3 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only --no-pass-profile
      --max-new-tokens 32)
uptime
flock /tmp/mg-measure.lock .venv/bin/margingate bench --model "$Q" --batch-sizes 1 --limit 4 "${ARGS[@]}" --out $O/b1
flock /tmp/mg-measure.lock .venv/bin/margingate bench --model "$Q" --batch-sizes 16 --limit 16 "${ARGS[@]}" --out $O/b16
uptime
