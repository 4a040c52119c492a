"""`batch-invariant`: every reduction in this request's forward has an order that does
not depend on the batch.

On CPU only the batched, padded attention call breaks invariance (bf16 GEMM
rows are batch-invariant once a single row is padded to two, see
`models.llama.Linear`; norms reduce per row), so the request's attention runs
over exactly its own prefix inside the shared batch while the other requests
keep the fast call: a per-request mode. Where GEMMs are not row-invariant
(GPUs with split-K) the runner computes such rows in their own row-wise pass.
"""
from ..engine.policy import Policy


class BatchInvariantPolicy(Policy):
    name = "batch-invariant"
    exact_attention = True
