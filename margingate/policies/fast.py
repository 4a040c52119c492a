"""`fast`: plain batched BF16 decoding, the speed baseline. No promise of determinism."""
from ..engine.policy import Policy


class FastPolicy(Policy):
    name = "fast"
