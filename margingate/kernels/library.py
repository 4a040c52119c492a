"""The library kernel set: PyTorch's own ops, as other engines run them.

Batch-variant by nature: GEMMs pick algorithms and thread splits by shape, and the
decode attention is one SDPA call over the batch padded to its longest row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm: fp32 statistics, cast back, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def length_mask(lengths: torch.Tensor, lmax: int) -> torch.Tensor | None:
    """Key-padding mask for `batched_attention` ([B, 1, 1, lmax]); None when every row has lmax keys."""
    if bool((lengths == lmax).all()):
        return None
    return (torch.arange(lmax, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


def batched_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One decode query per row, one SDPA call over the padded batch.
    q: [B, H, D]; k, v: [B, Hkv, Lmax, D]; mask from `length_mask`.

    The query heads sharing a KV head become that head's query rows ([B, Hkv, H/Hkv, D]):
    one SDPA row block per KV head instead of a q_len=1 call per query head."""
    b, h, d = q.shape
    out = F.scaled_dot_product_attention(q.view(b, k.shape[1], h // k.shape[1], d), k, v, attn_mask=mask)
    return out.reshape(q.shape)
