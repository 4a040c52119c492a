#!/bin/bash
# Kernels v11's checks: a register tile of the AVX512-BF16 linear keeps its sums in registers over its
# blocks (acc + (e + o) per block, as before; only the load and store per block are gone). Every
# deterministic policy on the default path (avx512bf16 here): the bf16 weights (--weights bf16) at
# default threads, the embedded file kept quantized at --threads 1. The forced avx512 and avx2 paths did
# not change. Each digest must equal kernels v6's: 4453dc1065a249fb. A finished run is kept; about 12
# minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/../../.."
O=results/check/kernels-v11
. results/check/run_check.sh
for p in reference batch-invariant margin dvr; do
  run $p-bf16-threads-default --policy $p --weights bf16
  run $p-auto-threads-1 --policy $p --weights auto --threads 1
done
