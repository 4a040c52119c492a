"""The model's layers as numerics, through one of three kernel sets.

A forward picks its set once (`kernel_set`: its `KernelChoice` and the model's backend): `INVARIANT`
runs every Linear, norm and activation through our compiled CPU kernels over bf16 weights packed at
load (`packing.py`),
whatever the activations' dtype; `TRITON` through the batch-invariant Triton kernels (CUDA, or
CPU under Triton's interpreter) over the plain bf16 weights loaded; `LIBRARY` through PyTorch's
ops, with plain weights in the activations' dtype. The op order of each layer (the MLP, the final
norm and head) is fixed here, not in the model.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import invariant, library
from . import triton as triton_kernels
from .choice import KernelChoice
from .packing import PackedWeight
from .quant_pack import QuantWeight

Linear = Callable[..., torch.Tensor]  # (x [M, K], w [N, K], bias [N] | None = None) -> [M, N]


@dataclass(frozen=True)
class KernelSet:
    name: str
    linear: Linear
    rmsnorm: Callable[..., torch.Tensor]  # (x, weight, eps, mode=0: LayerSpec.norm_mode)
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor]
    own_weights: bool  # True: the model's bf16 weights as loaded (packed for INVARIANT), for any activation dtype
    experts: Callable[..., torch.Tensor] | None = None  # (x, router, expert_set): an MoE block in one call
    route: Callable[..., tuple] | None = None  # (router logits, k, normalize) -> (experts, weights); None: moe.route
    swiglu_clamped: Callable[..., torch.Tensor] | None = None  # (gate_up, alpha, limit): gpt-oss's experts

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """down(act(gate) * up), gate|up fused in one weight; act is SiLU, or GELU-tanh (Gemma)."""
        act = self.gelu_tanh_mul if gelu else self.silu_mul
        return self.linear(act(self.linear(x, gate_up)), down)

    def biased_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, biases: tuple,
                   swiglu: tuple[float, float]) -> torch.Tensor:
        """gpt-oss's expert: down(swiglu_clamped(gate_up(x) + b1) ) + b2, `swiglu` its (alpha, limit)."""
        if self.swiglu_clamped is None:
            raise ValueError(f"the {self.name} kernels have no clamped SwiGLU (gpt-oss's experts)")
        return self.linear(self.swiglu_clamped(self.linear(x, gate_up, biases[0]), *swiglu), down, biases[1])

    def logits(self, h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float,
               norm_mode: int = 0) -> torch.Tensor:
        """The final norm and the head, in the activations' dtype, then widened to fp32."""
        return self.linear(self.rmsnorm(h, norm, eps, norm_mode), lm_head).float()


INVARIANT = KernelSet("invariant", invariant.linear, invariant.rmsnorm, invariant.silu_mul, invariant.gelu_tanh_mul,
                      own_weights=True, experts=invariant.moe_block, swiglu_clamped=invariant.swiglu_clamped)
TRITON = KernelSet("triton", triton_kernels.linear, triton_kernels.rmsnorm, triton_kernels.silu_mul,
                   triton_kernels.gelu_tanh_mul, own_weights=True, swiglu_clamped=triton_kernels.swiglu_clamped)
LIBRARY = KernelSet("library", library.linear, library.rmsnorm, library.silu_mul, library.gelu_tanh_mul,
                    own_weights=False, swiglu_clamped=library.swiglu_clamped)


def kernel_set(kernel_choice: KernelChoice, triton: bool = False) -> KernelSet:
    """The set `kernel_choice` names: the invariant set of the model's backend (`triton`: the Triton
    kernels), or the library's."""
    if kernel_choice is KernelChoice.LIBRARY:
        return LIBRARY
    return TRITON if triton else INVARIANT


def embed(tokens: torch.Tensor, table: torch.Tensor | PackedWeight | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the embedding table (packed when it is the tied head, or kept quantized), cast to the
    activations' dtype (exact lookups)."""
    rows = table.rows(tokens) if isinstance(table, (PackedWeight, QuantWeight)) else F.embedding(tokens, table)
    return rows.to(dtype)
