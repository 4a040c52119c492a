#!/bin/bash
# Kernels v9's checks (issues 32 and 33): every deterministic policy at default threads and at 1, on the
# default path (avx512bf16 here), on bf16 weights (the AVX512-BF16 linear at 5-16 rows now regroups packed
# bf16 weights in registers) and on the embedded model kept quantized (its 4-bit codes are now laid out
# for the chains before they are dequantized). The forced avx512 and avx2 paths did not change. Each
# digest must equal kernels v6's: 4453dc1065a249fb. A finished run is kept; about 24 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/../../.."
O=results/check/kernels-v9
. results/check/run_check.sh
for weights in bf16 auto; do
  for p in reference batch-invariant margin dvr; do
    run $p-$weights-threads-default --policy $p --weights $weights
    run $p-$weights-threads-1 --policy $p --weights $weights --threads 1
  done
done
