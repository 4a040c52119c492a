#!/bin/bash
# Kernels v9's checks (issue 32), after the AVX512-BF16 linear at 5-16 rows began regrouping packed bf16
# weights in registers (and prefetching the next panels' slice across the row tiles). That path reads
# packed bf16 weights, so these runs take --weights bf16 (the embedded model's quantized matrices would
# go through the unchanged quantized kernel): every deterministic policy at default threads and at 1,
# on the default path (avx512bf16 here; the forced avx512 and avx2 paths did not change). Each digest
# must equal kernels v6's: 4453dc1065a249fb. A finished run is kept; about 12 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export MARGINGATE_CACHE="${MARGINGATE_CACHE:-$PWD/.cache}"
O=results/check/kernels-v9
run() {  # name, then check's arguments
  local name=$1; shift
  grep -q 'token ids sha256' $O/$name.txt 2>/dev/null || \
    .venv/bin/margingate check --weights bf16 --modes hetero,staggered --batch-sizes 4,16 --out $O/$name.json "$@" \
      > $O/$name.txt 2>/dev/null
  echo "$name: $(grep -o 'token ids sha256 [0-9a-f]*' $O/$name.txt) $(grep '^  all' $O/$name.txt | awk '{print $3}')"
}
for p in reference batch-invariant margin dvr; do
  run $p-bf16-threads-default --policy $p
  run $p-bf16-threads-1 --policy $p --threads 1
done
