#!/usr/bin/env bash
# Everything a lent GPU box runs, in one call of under 10 minutes: the quick gpu_bench (check for every policy
# and bench on the random 1B model), then the paper's table on the Llama-3.1-8B shape, then on the Qwen2.5-14B
# shape at B = 8 and 32 if time is left. Each part runs under its own limit, so a slow part cuts only itself.
#   scripts/gpu_run.sh OUT_DIR [WHEELS] [BASE]
# OUT_DIR gets bench.log, bench_summary.md, bench_report.json, p8/ and p14/ (paper.json, paper.md) and their logs.
# WHEELS (default .whl): gguf and llguidance wheels for an offline box (scripts/gpu_bench.sh --offline);
# BASE (default .gpu-base): the embedded model's config.json and tokenizer files, for the random model.
# Dry run: `results/gpu/paper_table.py --device cpu` and `scripts/gpu_bench.sh --device cpu`.
set -uo pipefail
OUT_DIR=${1:?usage: scripts/gpu_run.sh OUT_DIR [WHEELS] [BASE]}
WHEELS=${2:-.whl}
BASE=${3:-.gpu-base}
cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} MARGINGATE_CACHE=${MARGINGATE_CACHE:-/tmp/margingate}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

timeout "${BENCH_S:-300}" bash scripts/gpu_bench.sh --offline "$WHEELS" --base "$BASE" --quick \
  > "$OUT_DIR/bench.log" 2>&1
echo "gpu_bench: exit $?"
summary=$(ls -t results/gpu/*/summary.md | head -1)
cp "$summary" "$OUT_DIR/bench_summary.md"
cp "$(dirname "$summary")/random-1b/bench/report.json" "$OUT_DIR/bench_report.json" 2>/dev/null
tail -c 1500 "$OUT_DIR/bench.log"
cat "$OUT_DIR/bench_summary.md"

run_table() {  # name, seconds, out folder, extra arguments
  PYTHONPATH=$PWD timeout "$2" python3 results/gpu/paper_table.py --shapes "$1" --out "$OUT_DIR/$3" "${@:4}" \
    > "$OUT_DIR/$3.log" 2>&1
  echo "paper_table $1: exit $?"
  tail -c 3000 "$OUT_DIR/$3.log"
}
run_table llama-3.1-8b "${P8_S:-200}" p8
run_table qwen2.5-14b "${P14_S:-60}" p14 --batch-sizes 8,32
