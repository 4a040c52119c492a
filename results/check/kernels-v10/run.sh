#!/bin/bash
# Kernels v10's checks (issue 33): every deterministic policy at default threads and at 1, on the
# default path (avx512bf16 here), on the embedded model kept quantized (the AVX512-BF16 dequantizer now
# looks 4-bit codes up, forms scale * q + offset in one FMA and subtracts zero points from code bytes).
# Nothing else changed: the bf16 linear and the forced avx512 and avx2 paths keep kernels v9's and v8's
# checks. Each digest must equal kernels v6's: 4453dc1065a249fb. A finished run is kept; about 12
# minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/../../.."
O=results/check/kernels-v10
. results/check/run_check.sh
for p in reference batch-invariant margin dvr; do
  run $p-auto-threads-default --policy $p --weights auto
  run $p-auto-threads-1 --policy $p --weights auto --threads 1
done
