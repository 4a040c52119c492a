"""The paper's table on one GPU (`results/gpu/paper_table.py`): MarginGate against LLM-42's
decode-verify-rollback at the hardware's speed, on random-weight models of the paper's shapes.

- `shapes`: the models and three disjoint prompt sets (calibration, check, timed);
- `calibration`: tau by `margingate calibrate`'s rule, on the calibration set, at the table's batch sizes;
- `protocol`: the check (sequence determinism, digests) and the timed points (warm-up, repeats, prefill apart);
- `engines`: engines with CUDA graphs, falling back to eager when a capture fails, and saying so;
- `store`: the report, saved after every point, resumed, and stopped by a deadline or a signal;
- `report`: the markdown.
"""
