#!/bin/bash
# Kernels v6 checks (the results in this folder): every deterministic policy at default and 1 thread and with each
# non-default linear path forced, then the inverse control (fast). 24 minutes on 2 cores.
cd /work/main
export MARGINGATE_CACHE=$PWD/.cache
O=results/check
for p in reference batch-invariant margin dvr; do
  .venv/bin/margingate check --policy $p --modes hetero,staggered --batch-sizes 4,16 --out $O/$p-threads-default.json > $O/$p-threads-default.txt 2>/dev/null
  .venv/bin/margingate check --policy $p --modes hetero,staggered --batch-sizes 4,16 --threads 1 --out $O/$p-threads-1.json > $O/$p-threads-1.txt 2>/dev/null
  for isa in avx512 avx2; do
    MARGINGATE_FORCE_ISA=$isa .venv/bin/margingate check --policy $p --modes hetero,staggered --batch-sizes 4,16 --out $O/$p-isa-$isa.json > $O/$p-isa-$isa.txt 2>/dev/null
  done
done
.venv/bin/margingate check --policy fast --modes hetero,staggered --batch-sizes 4,16 --out $O/fast-threads-default.json > $O/fast-threads-default.txt 2>/dev/null
echo ALLDONE
