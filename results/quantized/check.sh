#!/bin/bash
# The bf16-bits contract's determinism checks: the embedded model kept quantized (--weights exact: Q4_1
# matrices, Q8_0 head) under every deterministic policy, at default threads and at 1, and with each
# non-default linear path forced. Each digest must equal the bf16 weights' (results/check, 4453dc1065a249fb).
# The runs in check/ were made when this contract was the default (`auto`, kernels version 7); run names
# keep that word.
set -uo pipefail
cd "$(dirname "$0")/../.."
O=results/quantized/check
. results/check/run_check.sh
for p in reference batch-invariant margin dvr; do run $p-auto-threads-default --policy $p --weights exact; done
for p in reference batch-invariant margin dvr; do
  run $p-auto-threads-1 --policy $p --weights exact --threads 1
  for isa in avx512 avx2; do MARGINGATE_FORCE_ISA=$isa run $p-auto-isa-$isa --policy $p --weights exact; done
done
