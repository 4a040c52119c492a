"""RoPE scaling: how a config stretches the rotary frequencies for long contexts.

Implemented: Llama 3's (`rope_type: llama3`, every Llama 3.1 / 3.2 / 3.3 checkpoint), linear position
interpolation, and a GGUF's `rope_freqs` tensor (llama.cpp's form of Llama 3's: one divisor per
frequency). Any other type (yarn, dynamic, longrope, ...) is refused by name, never run as plain RoPE.
The frequencies are computed as transformers computes them (fp32 tensor ops, same order), so a position's
cos/sin are the bits transformers' rotary embedding holds.
"""
from __future__ import annotations

import math

SUPPORTED = ("default", "llama3", "linear")


def parse(raw: dict, name: str) -> tuple:
    """The scaling of config.json `raw` (transformers 4's `rope_scaling` or 5's `rope_parameters`): () for
    plain RoPE, ("linear", factor) or ("llama3", factor, low_freq_factor, high_freq_factor, original
    context); a ValueError naming what is wrong or unsupported."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED:
        raise ValueError(f"{name}: RoPE scaling of type {kind!r} is not supported ({', '.join(SUPPORTED)} are)")
    if kind == "default":
        return ()
    try:
        factor = float(params["factor"])
        if kind == "linear":
            scaling = ("linear", factor)
        else:
            scaling = ("llama3", factor, float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                       float(params["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{name}: {kind} RoPE scaling needs numeric {exc}: {params!r}") from exc
    if factor <= 0 or (kind == "llama3" and not 0 < scaling[2] < scaling[3]):
        raise ValueError(f"{name}: {kind} RoPE scaling {params!r}: factor must be > 0 and "
                         "0 < low_freq_factor < high_freq_factor")
    return scaling


def inv_freq(head_dim: int, theta: float, scaling: tuple = (), freq_factors: tuple = ()):
    """The fp32 inverse frequencies of one head (a tensor), scaled as `scaling` or `freq_factors` (a
    GGUF's) say. torch is imported here: reading a config needs none."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors:
        factors = torch.tensor(freq_factors, dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"rope_freqs holds {factors.numel()} factors for {inv.numel()} frequencies")
        return inv / factors
    if not scaling:
        return inv
    if scaling[0] == "linear":
        return inv / scaling[1]
    return _llama3(inv, *scaling[1:])


def _llama3(inv, factor: float, low: float, high: float, context: float):
    """Llama 3's: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    import torch

    low_wavelen, high_wavelen = context / low, context / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
