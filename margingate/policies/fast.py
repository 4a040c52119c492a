"""`fast`: plain batched BF16 decoding with the library's kernels (GEMMs, one padded attention
call over the batch), the speed baseline and the inverse control. No promise of determinism.
(Its prompt is prefilled like every request's, by the invariant kernels.)"""
from ..engine.policy import Policy


class FastPolicy(Policy):
    name = "fast"
