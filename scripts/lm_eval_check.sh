#!/usr/bin/env bash
# lm-evaluation-harness against `margingate serve`: the two local tasks in evals/ (margingate_choice:
# loglikelihood multiple choice; margingate_arith: greedy generate_until), three times, the third beside
# 8 streaming clients (scripts/stream_load.py); then scripts/compare_lm_eval.py checks that every item's
# loglikelihoods / generated text and every score are bitwise the same in the three runs.
#
#   make venv lmeval-venv && scripts/lm_eval_check.sh    # -> results/lm-eval/{run1,run2,run3,summary.json}
#
# Env: MODEL (default smollm2-135m), POLICY (serve --default-policy, default batch-invariant),
# OUT (default results/lm-eval), LIMIT (lm_eval --limit, default all items), SERVE_ARGS (more serve flags);
# MARGINGATE_CACHE (where the model folder is) is read as by every margingate command.
# Offline: the tasks read evals/data/*.jsonl (paths relative to the repo root, where this runs) and the
# tokenizer is read from the model's local folder; HF_*_OFFLINE forbid any hub access.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-smollm2-135m}
POLICY=${POLICY:-batch-invariant}
OUT=${OUT:-results/lm-eval}
PY=.venv/bin/python
LM_EVAL=.venv-lmeval/bin/lm_eval
[[ -x $PY && -x $LM_EVAL ]] || { echo "lm_eval_check: run 'make venv lmeval-venv' first" >&2; exit 1; }
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

MODEL_DIR=$($PY -c "from margingate.models.loader import resolve_model_dir; print(resolve_model_dir('$MODEL'))")
PORT=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"

SERVER= LOAD=
cleanup() {
    for pid in $LOAD $SERVER; do kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
# --deterministic-by-default: lm_eval's loglikelihood bodies are fixed (no "deterministic" field), so
# every request the server gets runs under $POLICY.
.venv/bin/margingate serve --port "$PORT" --model "$MODEL" --default-policy "$POLICY" --deterministic-by-default \
    ${SERVE_ARGS:-} \
    > "$OUT/server.log" 2>&1 &
SERVER=$!
echo "lm_eval_check: margingate serve on $URL (pid $SERVER, log $OUT/server.log); waiting for /health"
for _ in $(seq 600); do
    curl -sf "$URL/health" > /dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { echo "lm_eval_check: the server exited" >&2; tail -20 "$OUT/server.log" >&2; exit 1; }
    sleep 1
done
curl -sf "$URL/health" > /dev/null || { echo "lm_eval_check: no /health after 600 s" >&2; exit 1; }

run_lm_eval() {  # $1: the run's folder
    rm -rf "$1"
    # model= names the server's model (and the output folder); tokenizer_backend=huggingface reads the
    # tokenizer from the model folder, without probing the server for /tokenizer_info.
    # --batch_size 4: four prompts per completions request (choices by index).
    $LM_EVAL --model local-completions \
        --model_args "model=$MODEL,base_url=$URL/v1/completions,tokenizer=$MODEL_DIR,tokenizer_backend=huggingface" \
        --batch_size 4 \
        --tasks margingate_choice,margingate_arith --include_path evals ${LIMIT:+--limit "$LIMIT"} \
        --log_samples --output_path "$1" 2>&1 | tee "$1.log"
}

run_lm_eval "$OUT/run1"
run_lm_eval "$OUT/run2"
$PY scripts/stream_load.py --base-url "$URL/v1" --clients 8 > "$OUT/stream_load.log" 2>&1 &
LOAD=$!
sleep 5  # the streams are under way before lm_eval starts
run_lm_eval "$OUT/run3"
kill "$LOAD"
wait "$LOAD" || { echo "lm_eval_check: stream_load reported errors" >&2; cat "$OUT/stream_load.log" >&2; exit 1; }
LOAD=
cat "$OUT/stream_load.log"

$PY scripts/compare_lm_eval.py "$OUT/run1" "$OUT/run2" "$OUT/run3" --out "$OUT/summary.json"
