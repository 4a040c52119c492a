#!/bin/bash
# Kernels v7's figures (issue 32), at all cores (2 here), every contender at the same thread count, one
# command per figure: the linear against oneDNN on the 1B shapes; the 1B random model against vLLM and
# llama.cpp (B = 16 decode with decode-only beside end-to-end, the pass profile, one 2047-token prefill);
# the embedded 135M at B = 16 against both peers; echo scoring against vLLM; speculation at B = 16.
# Needs make vllm-venv and make llamacpp-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
M=$MARGINGATE_CACHE/random-1b
[ -f "$M/config.json" ] || .venv/bin/python scripts/make_random_model.py --size 1b --out "$M"
.venv/bin/margingate bench-linear --model "$M" --seconds 0.3 --out results/bench-v7/linear-1b
.venv/bin/margingate bench --model "$M" --batch-sizes 16 --limit 16 --max-new-tokens 32 --repeats 1 --warmup 1 \
  --policies fast,batch-invariant --peers vllm,llamacpp --decode-only --out results/bench-v7/decode-1b
.venv/bin/margingate bench --model "$M" --prompts-file results/bench-1b/prompt_2048.jsonl --batch-sizes 1 \
  --max-new-tokens 1 --max-model-len 4096 --repeats 2 --warmup 1 --policies fast,batch-invariant \
  --peers vllm,llamacpp --no-pass-profile --out results/bench-v7/prefill-1b
.venv/bin/margingate bench --batch-sizes 16 --limit 16 --max-new-tokens 128 --repeats 2 --warmup 1 \
  --policies fast,batch-invariant --peers vllm,llamacpp --decode-only --no-pass-profile --out results/bench-v7/smollm2-b16
.venv/bin/margingate bench-score --vllm --out results/bench-v7/score
.venv/bin/margingate bench-spec --k 8 --out results/bench-v7/spec
