"""`batch-invariant`: every reduction in this request's forward has an order fixed by the row
alone (the invariant kernels: Linear, norms, activation and attention over exactly its own
prefix), inside the shared batch.

Per request, not a global mode: when such a request shares a step, that forward's
Linear/norm kernels are the invariant ones for every row (they cost no more here), while
other requests keep the padded batched attention.
"""
from ..engine.policy import Policy


class BatchInvariantPolicy(Policy):
    name = "batch-invariant"
    exact_attention = True
    speculates = True
