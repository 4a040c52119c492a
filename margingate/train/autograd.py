"""The invariant kernels with gradients: the trainable model's kernel set.

Each op's forward is the engine's kernel on the engine's operands (bf16 weights packed for the
invariant linear, bf16 activations), so a trainer's forward gives the engine's bits. Each op's
backward is the gradient of the plain-torch math of the same op (`REFERENCE`), recomputed in fp32
(fp64 inputs stay fp64, so `torch.autograd.gradcheck` can check it): gradients need not be
bitwise, they must be right. With fp64 inputs the forward runs that plain math too (the kernels
take bf16 or fp32 only), which is how a gradcheck reaches the backward.

A matrix reaches the ops as a `Param`: the differentiable tensor (a parameter, or q|k|v and
gate|up concatenated from parameters) with its bf16 panels packed for this forward.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import invariant, layers, library
from ..kernels.attention import AttentionRows, attend
from ..kernels.choice import KernelChoice
from ..kernels.layers import KernelSet
from ..kernels.packing import PackedWeight, pack
from ..models.kv_cache import KVPool

KERNEL_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Param:
    """A matrix as the trainable ops read it: `plain` [n, k] carries the gradient, `kernel` (its bf16 values as
    the backend's linear reads them: packed in panels for the compiled kernels, plain for Triton's) gives the
    forward's bits; None runs the plain math."""
    plain: torch.Tensor
    kernel: PackedWeight | torch.Tensor | None

    @classmethod
    def of(cls, plain: torch.Tensor, triton: bool = False) -> Param:
        if plain.dtype not in KERNEL_DTYPES:
            return cls(plain, None)
        bf16 = plain.detach().to(torch.bfloat16)
        return cls(plain, bf16 if triton else pack(bf16))


def _kernel(*xs: torch.Tensor | None) -> bool:
    """Do these inputs run the kernels (bf16 or fp32), or the plain math (fp64: gradcheck)?"""
    return all(x is None or x.dtype in KERNEL_DTYPES for x in xs)


def _bf16(t: torch.Tensor | None) -> torch.Tensor | None:
    """A norm's or bias's weight as the engine holds it (bf16: models/weights.py's build)."""
    return None if t is None else t.detach().to(torch.bfloat16)


def _widened(x: torch.Tensor) -> torch.Tensor:
    """x as the backward recomputes it: fp32, or fp64 where it is fp64."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32)).requires_grad_()


def vjp(reference: Callable[..., torch.Tensor], inputs: tuple, grad: torch.Tensor) -> tuple:
    """The gradient of `reference(*inputs)` (the plain-torch math) against `grad`, recomputed in fp32; None
    for inputs that are not float tensors or need none."""
    with torch.enable_grad():
        wide = [_widened(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
        wanted = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        out = reference(*wide)
        grads = torch.autograd.grad(out, [wide[i] for i in wanted], grad.to(out.dtype), allow_unused=True)
    full: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, grads):
        full[i] = g
    return tuple(full)


# --- the plain math of each op: what its gradient is taken of ---------------------------------------------------

def linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    scale = (1 + w) if unit_offset else w
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


silu_mul_ref, gelu_tanh_mul_ref = library.silu_mul, library.gelu_tanh_mul  # the library's ops are the plain math


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], scale: float,
                  window: int) -> torch.Tensor:
    """Causal attention of each sequence's rows over its own earlier rows (sequence s: rows [starts[s],
    starts[s + 1])), grouped-query heads as transformers repeats them; `window` > 0: the last `window` keys.
    The sequences are padded into one [sequences, heads, T, T] computation, padding keys masked."""
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    width, group = max(lengths), q.shape[1] // k.shape[1]
    slot = torch.cat([s * width + torch.arange(n, device=q.device) for s, n in enumerate(lengths)])

    def grid(x: torch.Tensor) -> torch.Tensor:  # rows -> [sequences, heads, T, D], zeros where padded
        out = x.new_zeros(len(lengths) * width, *x.shape[1:]).index_copy(0, slot, x)
        return out.view(len(lengths), width, *x.shape[1:]).transpose(1, 2)

    qs, ks, vs = grid(q), grid(k).repeat_interleave(group, 1), grid(v).repeat_interleave(group, 1)
    t = torch.arange(width, device=q.device)
    visible = (t[None, :] <= t[:, None]) & ((t[:, None] - t[None, :] < window) if window else True)
    probs = torch.softmax((qs @ ks.transpose(-1, -2) * scale).masked_fill(~visible, -torch.inf), dim=-1)
    out = (probs @ vs).transpose(1, 2).reshape(len(lengths) * width, *q.shape[1:])
    return out.index_select(0, slot)


def route_ref(logits: torch.Tensor, chosen: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The chosen experts' weights: softmax probabilities, divided by their sum where the model normalizes."""
    picked = torch.softmax(logits, dim=-1).gather(1, chosen)
    return picked / picked.sum(-1, keepdim=True) if normalize else picked


# --- the ops ----------------------------------------------------------------------------------------------------

class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, kernel_w, base):
        ctx.save_for_backward(x, w, b)
        if kernel_w is None or not _kernel(x):
            return linear_ref(x, w, b)
        return base.linear(x, kernel_w, _bf16(b))

    @staticmethod
    def backward(ctx, grad):
        x, w, b = ctx.saved_tensors
        wide = torch.promote_types(x.dtype, torch.float32)
        g = grad.to(wide)
        gx = g @ w.to(wide) if ctx.needs_input_grad[0] else None
        gw = g.T @ x.to(wide) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if b is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, unit_offset, base):
        ctx.save_for_backward(x, w)
        ctx.args = (eps, unit_offset)
        if not _kernel(x, w):
            return rmsnorm_ref(x, w, eps, unit_offset)
        return base.rmsnorm(x, _bf16(w), eps, unit_offset)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        eps, unit_offset = ctx.args
        gx, gw = vjp(lambda a, b: rmsnorm_ref(a, b, eps, unit_offset), (x, w), grad)
        return gx, gw, None, None, None


class _GatedActivation(torch.autograd.Function):
    """act(gate) * up of gate|up rows, SiLU or GELU-tanh."""

    @staticmethod
    def forward(ctx, gate_up, gelu, base):
        ctx.save_for_backward(gate_up)
        ctx.gelu = gelu
        if not _kernel(gate_up):
            return (gelu_tanh_mul_ref if gelu else silu_mul_ref)(gate_up)
        return (base.gelu_tanh_mul if gelu else base.silu_mul)(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        (g,) = vjp(gelu_tanh_mul_ref if ctx.gelu else silu_mul_ref, (gate_up,), grad)
        return g, None, None


class _Attention(torch.autograd.Function):
    """The rows' K/V written to the pool, then the engine's exact attention over each row's own prefix."""

    @staticmethod
    def forward(ctx, q, k, v, site):
        ctx.save_for_backward(q, k, v)
        ctx.args = (site.starts, site.scale, site.window)  # the site's window changes with the next layer
        if not _kernel(q, k, v):
            return attention_ref(q, k, v, site.starts, site.scale, site.window)
        rows = site.rows
        site.pool.write(0, rows.tables, rows.table_of, rows.positions, k, v)
        return attend(q, site.pool.layer(0), rows, q.dtype, site.scale, site.window)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        starts, scale, window = ctx.args
        return (*vjp(lambda a, b, c: attention_ref(a, b, c, starts, scale, window), (q, k, v), grad), None)


class _Route(torch.autograd.Function):
    """The engine's route (csrc/moe.cpp) of fp32 router logits -> (chosen experts, their weights)."""

    @staticmethod
    def forward(ctx, logits, k, normalize):
        chosen, weights = invariant.moe_route(logits.detach().float(), k, normalize)
        ctx.save_for_backward(logits, chosen)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(chosen)
        return chosen, weights

    @staticmethod
    def backward(ctx, _grad_chosen, grad):
        logits, chosen = ctx.saved_tensors
        (g,) = vjp(lambda x: route_ref(x, chosen, ctx.normalize), (logits,), grad)
        return g, None, None


@dataclass
class AttentionSite:
    """What one forward's attention reads besides q, k, v: the rows (one exact row per token), a one-layer
    pool their K/V pass through, each sequence's first row, the layer's scale and window."""
    rows: AttentionRows
    pool: KVPool
    starts: list[int]
    scale: float
    window: int = 0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, site: AttentionSite) -> torch.Tensor:
    return _Attention.apply(q, k, v, site)


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _Route.apply(logits.float(), k, normalize)


@functools.cache
def kernel_set(triton: bool = False) -> KernelSet:
    """The trainable ops over the invariant kernels of a backend: the compiled CPU ones, or Triton's."""
    base = layers.kernel_set(KernelChoice.INVARIANT, triton)

    def linear(x: torch.Tensor, w: Param, b: torch.Tensor | None = None) -> torch.Tensor:
        return _Linear.apply(x, w.plain, b, w.kernel, base)

    def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        return _RMSNorm.apply(x, w, eps, unit_offset, base)

    return KernelSet(f"train-{base.name}", linear, rmsnorm, lambda x: _GatedActivation.apply(x, False, base),
                     lambda x: _GatedActivation.apply(x, True, base), own_weights=True, route=route)


TRAIN = kernel_set()  # the compiled CPU kernels'
