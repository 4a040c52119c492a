#!/bin/bash
# Issue 65, item 2's figures on this machine (AMD EPYC Zen 4 on 2 cores): B = 1 decode against the read floor
# (scripts/roofline.py: the bandwidth and the steps in one run) for the 1B Q4_K_M, Q8_0 and the Qwen2.5-Coder
# 0.5B, then B = 16 decode on the 1B Q4_K_M beside llama.cpp on the same file, every contender at the same
# threads. Each under the measurement lock, `uptime` in every report.
#   bash results/roofline/run.sh [Q4_K_M.gguf] [Q8_0.gguf] [QWEN.gguf]
set -euo pipefail
cd "$(dirname "$0")/../.."
Q4=${1:-/tmp/mg-start/random-1b.q4_k_m.gguf}
Q8=${2:-/tmp/mg-start/random-1b.q8_0.gguf}
QW=${3:-$HOME/.cache/margingate/gguf/qwen2.5-coder-0.5b.gguf}
O=results/roofline
flock /tmp/mg-measure.lock env PYTHONPATH=$PWD .venv/bin/python scripts/roofline.py \
  --model "$Q4" --model "$Q8" --model "$QW" --out $O/after
MARGINGATE_LLAMACPP_PYTHON=${MARGINGATE_LLAMACPP_PYTHON:-.venv-llamacpp/bin/python} flock /tmp/mg-measure.lock .venv/bin/margingate bench --model "$Q4" --batch-sizes 16 --limit 16 --max-new-tokens 32 \
  --repeats 1 --warmup 1 --policies fast,batch-invariant --peers llamacpp --decode-only --no-pass-profile \
  --out $O/1b-q4_k_m-b16
