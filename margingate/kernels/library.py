"""The library kernel set: PyTorch's own ops, as other engines run them.

Batch-variant by nature: GEMMs pick algorithms and thread splits by shape, and the
decode attention is one SDPA call over the batch padded to its longest row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Hugging Face's RMSNorm: fp32 statistics; Llama casts back, then times the weight;
    Gemma (`unit_offset`) times (1 + weight) in fp32, then casts back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def length_mask(lengths: torch.Tensor, lmax: int, window: int = 0) -> torch.Tensor | None:
    """Key-padding mask for `batched_attention` ([B, 1, 1, lmax]): row b sees keys [0, lengths[b]),
    only the last `window` of them when window > 0. None when every row sees all lmax keys."""
    keys = torch.arange(lmax, device=lengths.device)[None, :]
    mask = keys < lengths[:, None]
    if window > 0:
        mask &= keys >= lengths[:, None] - window
    if bool(mask.all()):
        return None
    return mask[:, None, None, :]


def batched_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None) -> torch.Tensor:
    """One decode query per row, one SDPA call over the padded batch.
    q: [B, H, D]; k, v: [B, Hkv, Lmax, D]; mask from `length_mask`.

    The query heads sharing a KV head become that head's query rows ([B, Hkv, H/Hkv, D]):
    one SDPA row block per KV head instead of a q_len=1 call per query head."""
    b, h, d = q.shape
    out = F.scaled_dot_product_attention(q.view(b, k.shape[1], h // k.shape[1], d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(q.shape)
