"""Which kernels compute a forward's Linears, norms and activations: the one name for that choice,
from a policy through the engine to the model and its attention rows.

`INVARIANT`: ours, whose order is a function of the row alone (the compiled C++ kernels, or the
Triton ones on the `triton` backend: `DecoderModel.kernels` names the backend, not this choice).
`LIBRARY`: PyTorch's, batch-variant by nature, with the batched rows' attention in one padded SDPA call.
Plain data: no torch, so that anything may import it.
"""
from __future__ import annotations

import enum


class KernelChoice(enum.Enum):
    INVARIANT = "invariant"
    LIBRARY = "library"
