"""The library kernel set: PyTorch's own ops, as other engines run them.

Batch-variant by nature: GEMMs pick algorithms and thread splits by shape, and the
decode attention is one SDPA call over the batch padded to its longest row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = 0) -> torch.Tensor:
    """Hugging Face's RMSNorm: fp32 statistics; Llama (mode 0) casts back, then times the weight;
    Gemma (mode 1, or True) times (1 + weight) in fp32, gpt-oss (2) times the weight in fp32, then casts back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if mode == 2:
        return (weight.float() * h).to(x.dtype)
    if mode:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' activation as transformers writes it, over gate | up (de-interleaved at load)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


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
                      scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decode query per row, one SDPA call over the padded batch.
    q: [B, H, D]; k, v: [B, Hkv, Lmax, D]; mask from `length_mask`.

    The query heads sharing a KV head become that head's query rows ([B, Hkv, H/Hkv, D]):
    one SDPA row block per KV head instead of a q_len=1 call per query head. `sinks` [H] (gpt-oss): SDPA has
    none, so the scores, the sink joined to them and their softmax are written out as transformers' eager
    attention does."""
    b, h, d = q.shape
    qg = q.view(b, k.shape[1], h // k.shape[1], d)
    if sinks is None:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(q.shape)
    scores = (qg @ k.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, k.shape[1], h // k.shape[1], 1).expand(b, -1, -1, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return (probs.to(v.dtype) @ v).reshape(q.shape)
