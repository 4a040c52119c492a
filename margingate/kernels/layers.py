"""The model's layers as numerics, through one of the two kernel sets.

A forward picks its set once (`kernel_set`): `INVARIANT` runs every Linear, norm and
activation through our compiled kernels over bf16 weights, whatever the activations' dtype;
`LIBRARY` through PyTorch's ops, with the weights in the activations' dtype. The op order
of each layer (the MLP, the final norm and head) is fixed here, not in the model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import invariant, library

Linear = Callable[..., torch.Tensor]  # (x [M, K], w [N, K], bias [N] | None = None) -> [M, N]


@dataclass(frozen=True)
class KernelSet:
    name: str
    linear: Linear
    rmsnorm: Callable[..., torch.Tensor]  # (x, weight, eps, unit_offset=False)
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor]
    bf16_weights: bool  # True: the weights stay bf16 for any activation dtype

    def weight_dtype(self, activations: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.bf16_weights else activations

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """down(act(gate) * up), gate|up fused in one weight; act is SiLU, or GELU-tanh (Gemma)."""
        act = self.gelu_tanh_mul if gelu else self.silu_mul
        return self.linear(act(self.linear(x, gate_up)), down)

    def logits(self, h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float,
               unit_offset: bool = False) -> torch.Tensor:
        """The final norm and the head, in the activations' dtype, then widened to fp32."""
        return self.linear(self.rmsnorm(h, norm, eps, unit_offset), lm_head).float()


INVARIANT = KernelSet("invariant", invariant.linear, invariant.rmsnorm, invariant.silu_mul, invariant.gelu_tanh_mul,
                      bf16_weights=True)
LIBRARY = KernelSet("library", library.linear, library.rmsnorm, library.silu_mul, library.gelu_tanh_mul,
                    bf16_weights=False)


def kernel_set(use_invariant: bool) -> KernelSet:
    return INVARIANT if use_invariant else LIBRARY


def embed(tokens: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the embedding table, cast to the activations' dtype (exact lookups)."""
    return F.embedding(tokens, table).to(dtype)
