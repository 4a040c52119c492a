#!/usr/bin/env bash
# The one call a lent GPU box runs, in under 9 minutes of wall time (TOTAL_S, by this script's own clock):
#   1. env:   the GPU, torch and triton; kernels: the C++ kernels sampling reads logits with, built once per box
#             (1-3 minutes on 2 cores, well under a minute on 16) so no later part pays for it inside its limit
#             (a failure in either stops the run: nothing after it could run);
#   2. tests: the GPU-only pytest selection (captured graphs against eager, compiled kernels), TESTS_S;
#   3. p8:    the paper's table on the Llama-3.1-8B shape (results/gpu/paper_table.py), P8_S;
#   4. p14:   the table on the Qwen2.5-14B shape at B = 8 and 32, in what is left of TOTAL_S (at most P14_S;
#             skipped under MIN_PART_S).
#   scripts/gpu_run.sh [--dry-run] OUT
# OUT must be new or empty: everything in it is this run's. OUT/status.json says, per part, its status (ok,
# partial, timeout, failed, skipped), exit code, seconds against its limit, and for a table what it finished;
# rewritten after each part. Each part runs under `timeout` with its limit (the table also stops itself a grace
# period before it, and saves after every point); a failing part does not stop the next, but the run exits 1.
# --dry-run: the same parts and limits on CPU: toy shapes under Triton's interpreter, the test selection less
# its slowest policies (PYTHON=.venv/bin/python). P8_ARGS / P14_ARGS / TESTS_ARGS: extra arguments to a part.
set -euo pipefail
DRY=0
if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
OUT=${1:?usage: scripts/gpu_run.sh [--dry-run] OUT}
cd "$(dirname "$0")/.."
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then echo "gpu_run.sh: $OUT is not empty" >&2; exit 2; fi
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-540} TESTS_S=${TESTS_S:-90} P8_S=${P8_S:-270} P14_S=${P14_S:-150} MIN_PART_S=${MIN_PART_S:-60}
GRACE_S=${GRACE_S:-25}  # the table's own deadline comes this long before its part's limit: it ends and saves
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if [ "$DRY" = 0 ]; then export MARGINGATE_CACHE=${MARGINGATE_CACHE:-/tmp/margingate} MAX_JOBS=${MAX_JOBS:-16}; fi
START=$(date +%s.%N)
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
status() { "$PY" scripts/run_status.py "$OUT/status.json" "$@"; }
status start --dry-run "$DRY" --total-limit "$TOTAL_S"
trap 'rc=$?; status end --rc "$rc" --seconds "$(since "$START")"' EXIT
FAILED=0

part() {  # name limit report|- command...: the command under its limit, its output in OUT/name.log
  local name=$1 limit=$2 report=$3 t0 rc=0
  shift 3
  t0=$(date +%s.%N)
  status begin "$name" --limit "$limit"
  timeout -k 15 -s TERM "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  local extra=()
  [ "$report" = - ] || extra=(--report "$report")
  status part "$name" --rc "$rc" --seconds "$(since "$t0")" --limit "$limit" "${extra[@]}"
  echo "== $name: exit $rc after $(since "$t0") s (limit $limit s)"
  tail -c 2500 "$OUT/$name.log"
  if [ "$rc" != 0 ] && [ "$rc" != 3 ]; then FAILED=1; fi  # 3: the table's deadline left points out (partial)
}

if [ "$DRY" = 1 ]; then
  DEVICE=(--device cpu) SHAPE8=toy SHAPE14=toy-wide B14=2
  TESTS_K="not margin and not dvr"  # under the interpreter those two take a minute each
  export TRITON_INTERPRET=1
  ENV_CMD=("$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)")
else
  DEVICE=(--device cuda) SHAPE8=llama-3.1-8b SHAPE14=qwen2.5-14b B14=8,32 TESTS_K=""
  ENV_CMD=(bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader && $PY -c \
'import torch, triton; assert torch.cuda.is_available(); print(\"torch\", torch.__version__, \"triton\", \
triton.__version__)'")
fi
part env 60 - "${ENV_CMD[@]}"
if [ "$FAILED" = 0 ]; then part kernels "${KERNELS_S:-120}" - "$PY" -m margingate.kernels.invariant; fi
if [ "$FAILED" = 1 ]; then exit 1; fi

# shellcheck disable=SC2086  # the *_ARGS are word lists
part tests "$TESTS_S" - "$PY" -m pytest -q -p no:cacheprovider --junitxml "$OUT/tests.xml" \
  tests/test_triton_engine.py::test_triton_recorded_forwards_keep_every_bit \
  tests/test_triton_engine.py::test_rotary_tables_follow_the_positions_device \
  tests/test_triton_kernels.py::test_batch_invariance_compiled_on_cuda tests/test_step_graphs.py::test_capture_needs_a_gpu \
  ${TESTS_K:+-k "$TESTS_K"} ${TESTS_ARGS:-}

# shellcheck disable=SC2086
part p8 "$P8_S" "$OUT/p8/paper.json" "$PY" results/gpu/paper_table.py "${DEVICE[@]}" --shapes "$SHAPE8" \
  --out "$OUT/p8" --deadline-s "$((P8_S - GRACE_S))" ${P8_ARGS:-}

left=$(awk -v t="$TOTAL_S" -v s="$(since "$START")" 'BEGIN { printf "%d", t - s - 5 }')
limit14=$(( left < P14_S ? left : P14_S ))
if [ "$limit14" -lt "$MIN_PART_S" ]; then
  status skip p14 --why "${left} s left of TOTAL_S ${TOTAL_S}, under MIN_PART_S ${MIN_PART_S}"
else
  # shellcheck disable=SC2086
  part p14 "$limit14" "$OUT/p14/paper.json" "$PY" results/gpu/paper_table.py "${DEVICE[@]}" --shapes "$SHAPE14" \
    --batch-sizes "$B14" --out "$OUT/p14" --deadline-s "$((limit14 - GRACE_S))" ${P14_ARGS:-}
fi
cat "$OUT/status.json"
exit "$FAILED"
