#!/bin/bash
# Kernels v10's checks (issue 33): every deterministic policy at default threads and at 1, on the
# default path (avx512bf16 here), on the embedded model kept quantized (the AVX512-BF16 dequantizer now
# looks 4-bit codes up, forms scale * q + offset in one FMA and subtracts zero points from code bytes).
# Nothing else changed: the bf16 linear and the forced avx512 and avx2 paths keep kernels v9's and v8's
# checks. Each digest must equal kernels v6's: 4453dc1065a249fb. A finished run is kept; about 12
# minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/check/kernels-v10
run() {  # name, then check's arguments
  local name=$1; shift
  grep -q 'token ids sha256' $O/$name.txt 2>/dev/null || \
    .venv/bin/margingate check --modes hetero,staggered --batch-sizes 4,16 --out $O/$name.json "$@" > $O/$name.txt 2>/dev/null
  echo "$name: $(grep -o 'token ids sha256 [0-9a-f]*' $O/$name.txt) $(grep '^  all' $O/$name.txt | awk '{print $3}')"
}
for weights in auto; do
  for p in reference batch-invariant margin dvr; do
    run $p-$weights-threads-default --policy $p --weights $weights
    run $p-$weights-threads-1 --policy $p --weights $weights --threads 1
  done
done
