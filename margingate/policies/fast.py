"""`fast`: plain batched BF16 decoding with the library's kernels, the speed baseline and the
inverse control. No promise of determinism: its prompts too go through library GEMMs whose
results depend on how many rows share them."""
from ..engine.policy import Policy


class FastPolicy(Policy):
    name = "fast"
    invariant_prefill = False
