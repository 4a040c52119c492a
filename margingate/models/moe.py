"""Mixture-of-experts MLP with a router whose choice is a function of the row alone (issue 46).

Qwen3-MoE's and Mixtral's block, as transformers computes it, in one stated order:
1. router logits: the row through the invariant linear, in the activations' dtype;
2. softmax of the row with the kernels' own exp (`exp_shifted`) over their fixed-order fp64 sum, then
   each probability rounded once to fp32: no library softmax whose order could follow the ISA;
3. top-k by probability, ties broken by the lower expert index (a stable sort);
4. where the architecture normalizes (Mixtral always, Qwen3-MoE with `norm_topk_prob`), each kept
   weight divided by their sum, added left to right in rank order; then rounded to the activations' dtype;
5. each expert runs its rows through the invariant kernels (row-independent: a row's output cannot
   depend on which other rows chose the same expert), scaled by the row's weight, and the experts'
   outputs are added into the row by expert index, ascending, one rounding each.
So a row's output is the same bits alone or in any batch, at any thread count.

gpt-oss's block (`swiglu` set: its clamped SwiGLU's (alpha, limit)) differs in three places: the router and
every expert matrix add a bias (in the linear's epilogue); steps 2-4 become a stable top-k of the logits
themselves (ties to the lower expert), then the softmax of the k kept (exp of each minus the first, with the
kernels' exp, their sum in rank order, fp32); the experts gate with (clamp(up) + 1) * g * sigmoid(alpha g).
"""
from __future__ import annotations

import torch

from ..kernels import invariant


def route(logits: torch.Tensor, k: int, normalize: bool, topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (experts [N, k], weights [N, k] fp32), steps 2-4 of the module doc (compiled:
    csrc/moe.cpp, which the compiled block and stack call too); `topk_first`: gpt-oss's."""
    return invariant.moe_route(logits.float().cpu(), k, normalize, topk_first)


def moe_mlp(x: torch.Tensor, layer, k: int, normalize: bool, ops, swiglu: tuple = ()) -> torch.Tensor:
    """The block for rows x [N, hidden]: `layer` holds the router, the (gate_up, down) pairs per expert and,
    for our kernels, their `expert_set`; `ops` the kernel set (its linear and SwiGLU MLP). `swiglu`: gpt-oss's
    (alpha, limit), with the router's and the experts' biases in `layer`."""
    if ops.experts is not None:  # the invariant kernels: the whole block in one compiled call
        return ops.experts(x, layer.router, layer.expert_set)
    if swiglu and ops.route is not None:
        raise ValueError(f"the {ops.name} kernels do not run gpt-oss's mixture of experts")
    logits = ops.linear(x, layer.router, layer.router_bias)  # in x's dtype
    chosen, weights = (ops.route or route)(logits, k, normalize, *((True,) if swiglu else ()))
    return expert_loop(x, chosen.to(x.device), weights.to(x.device, x.dtype), layer.experts, ops,
                       layer.expert_biases, swiglu)


def expert_loop(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: list, ops,
                biases: list | None = None, swiglu: tuple = ()) -> torch.Tensor:
    """Step 5 of the module doc, one expert at a time: the Triton and library kernel sets' path, and the
    statement of the order the compiled block keeps (tests/test_moe_grouped.py compares the two bitwise)."""
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():  # ascending; an expert no row chose costs nothing
        rows, slot = (chosen == e).nonzero(as_tuple=True)  # a row chooses an expert once: rows are distinct
        y = ops.biased_mlp(x[rows], *experts[e], biases[e], swiglu) if swiglu else ops.mlp(x[rows], *experts[e])
        out[rows] += y * weights[rows, slot, None]
    return out
