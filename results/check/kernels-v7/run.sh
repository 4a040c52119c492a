#!/bin/bash
# Kernels v7's checks (issue 32), after the streaming linear and the grouped attention: every deterministic
# policy at default threads and at 1, and with each non-default linear path forced. Each digest must equal
# kernels v6's (../run-v6.sh): 4453dc1065a249fb. A finished run is kept; about 24 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/../../.."
O=results/check/kernels-v7
. results/check/run_check.sh
for p in reference batch-invariant margin dvr; do run $p-threads-default --policy $p; done
for p in reference batch-invariant margin dvr; do
  run $p-threads-1 --policy $p --threads 1
  for isa in avx512 avx2; do MARGINGATE_FORCE_ISA=$isa run $p-isa-$isa --policy $p; done
done
