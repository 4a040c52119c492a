#!/bin/bash
# Resident memory and decode speed at B = 16, every contender at 2 threads, one process at a time:
# 1. the 1B Q4_K_M (llama.cpp's own quantization of scripts/make_random_model.py --size 1b): ours beside
#    llama.cpp in one bench run (rss_mb in each report);
# 2. the embedded model at short context, this code beside the code before the paged KV cache ($BEFORE,
#    checked out into a temporary worktree, the same bench).
# Needs make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/kv-memory
BEFORE=${BEFORE:-4c8ae2d}
M=$MARGINGATE_CACHE/random-1b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 1b --out "$M"
Q=$MARGINGATE_CACHE/random-1b.q4_k_m.gguf
if [ ! -f "$Q" ]; then
  BF16=$(.venv/bin/python -c "from margingate.models.gguf_export import bf16_gguf; print(bf16_gguf('$M'))")
  .venv-llamacpp/bin/python scripts/quantize_gguf.py "$BF16" "$Q" q4_k_m
fi
A=(--batch-sizes 16 --limit 16 --max-new-tokens 32 --repeats 1 --warmup 1 --no-pass-profile --threads 2)
.venv/bin/margingate bench --model "$Q" "${A[@]}" --policies fast,batch-invariant --peers llamacpp \
  --out $O/1b-q4_k_m-b16
B=(bench "${A[@]}" --repeats 3 --policies fast,batch-invariant,margin)
ROOT=$PWD WT=$(mktemp -d)/before
git worktree add --detach "$WT" "$BEFORE" >/dev/null
(cd "$WT" && PYTHONPATH="$WT" "$ROOT/.venv/bin/python" -m margingate "${B[@]}" --out "$ROOT/$O/smollm2-b16-before")
git worktree remove --force "$WT"
.venv/bin/margingate "${B[@]}" --out $O/smollm2-b16
