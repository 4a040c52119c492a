#!/bin/bash
# The determinism protocol of results/check on the paged KV cache: batch-invariant and margin on bf16 weights
# (the digest results/check publishes), at default threads, at --threads 1, and in a KV pool too small for
# the batch (preemptions and recomputes), then batch-invariant with an int8 KV cache; each prints its token
# digest and its rate.
set -euo pipefail
cd "$(dirname "$0")/../.."
O=results/kv-check
source results/check/run_check.sh
# 48 blocks of 16 positions: the 16-prompt batch outgrows it, so requests are preempted and recomputed
SMALL=$(.venv/bin/python -c "from margingate.engine.pool import bytes_per_position as b; from margingate.models.loader \
import load_config, resolve_model_dir as r; print(48 * 16 * b(load_config(r('smollm2-135m')), 'bfloat16') / 1e9)")
for p in batch-invariant margin; do
  run $p-threads-default --policy $p --weights bf16
  run $p-threads-1 --policy $p --weights bf16 --threads 1
  run $p-small-pool --policy $p --weights bf16 --kv-cache-memory "$SMALL"
done
run batch-invariant-int8-kv --policy batch-invariant --weights bf16 --kv-cache-dtype int8
