"""`fast`: plain batched BF16 decoding, the speed baseline and the inverse control. No promise.

It runs the fastest kernels the engine has, which here are our compiled ones, and its decode
rows attend as one padded batch: key chunks aligned to the batch's longest row, as a padded
batched kernel walks them, so a row's bits depend on its neighbours (measured: a third of
the sequences change with the batch).

`fast-library`: the same through PyTorch's library kernels (oneDNN GEMMs, one padded SDPA
call): the engine a user gets without ours, whose GEMMs also pick algorithms by batch shape.
(Prompts are prefilled like every request's, by the invariant kernels.)"""
from ..engine.policy import Policy
from ..kernels.choice import KernelChoice


class FastPolicy(Policy):
    name = "fast"
    speculates = True


class FastLibraryPolicy(Policy):
    name = "fast-library"
    kernel_choice = KernelChoice.LIBRARY
    speculates = True
