#!/bin/bash
# The bf16 contract's checks (the files in this folder): every deterministic policy at default threads, at 1
# thread and with each non-default linear path forced, then the inverse control (fast). The embedded model
# dequantized to bf16 (--weights bf16). About 25 minutes on 2 cores; a finished run is kept.
set -uo pipefail
cd "$(dirname "$0")/../.."
O=results/check
. results/check/run_check.sh
for p in reference batch-invariant margin dvr; do
  run $p-threads-default --policy $p --weights bf16
  run $p-threads-1 --policy $p --weights bf16 --threads 1
  for isa in avx512 avx2; do MARGINGATE_FORCE_ISA=$isa run $p-isa-$isa --policy $p --weights bf16; done
done
run fast-threads-default --policy fast --weights bf16
