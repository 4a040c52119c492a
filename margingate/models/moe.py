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
"""
from __future__ import annotations

import torch

from ..kernels import invariant


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [N, E] -> (experts [N, k], weights [N, k] fp32), steps 2-4 of the module doc."""
    logits = logits.float().cpu().contiguous()
    top = logits.max(dim=-1, keepdim=True).values
    probs = (invariant.exp_shifted(logits, top[:, 0]).double() / invariant.sum_exp_rows(logits)[:, None]).float()
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = probs.gather(1, experts)
    if normalize:
        total = weights[:, 0].clone()
        for j in range(1, k):
            total = total + weights[:, j]
        weights = weights / total[:, None]
    return experts, weights


def moe_mlp(x: torch.Tensor, router, experts: list, k: int, normalize: bool, ops) -> torch.Tensor:
    """The block for rows x [N, hidden]: `router` the gate matrix, `experts` (gate_up, down) per expert,
    `ops` the kernel set (its linear and SwiGLU MLP)."""
    chosen, weights = route(ops.linear(x, router), k, normalize)  # logits in x's dtype, as transformers has them
    chosen, weights = chosen.to(x.device), weights.to(x.device, x.dtype)
    if ops.experts is not None:  # the invariant kernels: the loop below, in one compiled call
        return ops.experts(x, chosen, weights, experts)
    return expert_loop(x, chosen, weights, experts, ops)


def expert_loop(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: list, ops) -> torch.Tensor:
    """Step 5 of the module doc, one expert at a time: the Triton and library kernel sets' path, and the
    statement of the order `ops.experts` keeps (tests compare the two bitwise)."""
    out = torch.zeros_like(x)
    for e in torch.unique(chosen).tolist():  # ascending; an expert no row chose costs nothing
        rows, slot = (chosen == e).nonzero(as_tuple=True)  # a row chooses an expert once: rows are distinct
        out[rows] += ops.mlp(x[rows], *experts[e]) * weights[rows, slot, None]
    return out
