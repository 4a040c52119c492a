#!/usr/bin/env bash
# Issue 15 measurements (run from the repository root; .venv from `make venv`).
set -euo pipefail
M=.venv/bin/margingate
P=results/ray/held_in_32.jsonl
lscpu > results/ray/lscpu.txt
# 32 held-in prompts: the first 32 of the calibration set (champ, seed 0, <= 400 prompt tokens; the profile's 48)
.venv/bin/python -c "
import json
from margingate.data.datasets import dataset_prompts
from margingate.models.loader import resolve_model_dir
from margingate.models.tokenizer import Tokenizer
ps = dataset_prompts('champ', 32, 0, Tokenizer(resolve_model_dir('smollm2-135m')), 400)
open('$P', 'w').write(''.join(json.dumps({'prompt': p.messages[0]['content']}) + '\n' for p in ps))"
for policy in batch-invariant margin; do
  $M generate --prompts-file $P --max-new-tokens 128 --policy $policy --json > results/ray/local_$policy.jsonl
  $M generate --prompts-file $P --max-new-tokens 128 --policy $policy --json \
     --ray --ray-workers 2 --threads-per-worker 1 > results/ray/ray_$policy.jsonl
done
# Equality: whole lines, and without `stats` (margin's counters describe the batches a request shared)
.venv/bin/python -c "
import json
for policy in ('batch-invariant', 'margin'):
    local, ray = ([json.loads(x) for x in open(f'results/ray/{w}_{policy}.jsonl')] for w in ('local', 'ray'))
    strip = lambda rows: [{k: v for k, v in r.items() if k != 'stats'} for r in rows]
    print(f'{policy}: {len(local)} local / {len(ray)} Ray lines, {sum(map(len, (r[\"token_ids\"] for r in local)))} '
          f'tokens; identical lines {sum(a == b for a, b in zip(local, ray))}/{len(local)}; '
          f'identical without stats {sum(a == b for a, b in zip(strip(local), strip(ray)))}/{len(local)}')
" | tee results/ray/equality.txt
.venv/bin/python scripts/ray_scaling.py --prompts-file $P --max-new-tokens 128 --policies fast,batch-invariant \
  --shapes 1x2,2x1 --repeats 2 --out results/ray/scaling
