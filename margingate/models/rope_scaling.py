"""RoPE scaling: how a config stretches the rotary frequencies for long contexts.

Implemented: Llama 3's (`rope_type: llama3`, every Llama 3.1 / 3.2 / 3.3 checkpoint), linear position
interpolation, YaRN (gpt-oss: frequencies blended by a linear ramp, cos and sin times an attention factor),
and a GGUF's `rope_freqs` tensor (llama.cpp's form of Llama 3's: one divisor per frequency). Any other type
(dynamic, longrope, ...) is refused by name, never run as plain RoPE.
The frequencies are computed as transformers computes them (fp32 tensor ops, same order), so a position's
cos/sin are the bits transformers' rotary embedding holds.
"""
from __future__ import annotations

import math

SUPPORTED = ("default", "llama3", "linear", "yarn")


def parse(raw: dict, name: str) -> tuple:
    """The scaling of config.json `raw` (transformers 4's `rope_scaling` or 5's `rope_parameters`): () for
    plain RoPE, ("linear", factor), ("llama3", factor, low_freq_factor, high_freq_factor, original
    context) or ("yarn", factor, beta_fast, beta_slow, original context, truncate, attention factor); a
    ValueError naming what is wrong or unsupported."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED:
        raise ValueError(f"{name}: RoPE scaling of type {kind!r} is not supported ({', '.join(SUPPORTED)} are)")
    if kind == "default":
        return ()
    try:
        factor = float(params["factor"])
        if kind == "yarn":
            return _yarn(params, factor, name)
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


def _yarn(params: dict, factor: float, name: str) -> tuple:
    """YaRN's parameters as transformers reads them (`_compute_yarn_parameters`), its attention factor computed."""
    if factor <= 1:
        raise ValueError(f"{name}: yarn RoPE scaling needs factor > 1: {params!r}")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    factor_of = params.get("attention_factor")
    if factor_of is None:
        def get(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0
        factor_of = get(mscale) / get(mscale_all) if mscale and mscale_all else get(1.0)
    return ("yarn", factor, float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
            float(params["original_max_position_embeddings"]), bool(params.get("truncate", True)), float(factor_of))


def attention_factor(scaling: tuple) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 for every other scaling)."""
    return scaling[6] if scaling and scaling[0] == "yarn" else 1.0


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
    if scaling[0] == "yarn":
        return _yarn_inv_freq(head_dim, theta, *scaling[1:6])
    return _llama3(inv, *scaling[1:])


def _yarn_inv_freq(dim: int, base: float, factor: float, beta_fast: float, beta_slow: float, context: float,
                   truncate: bool):
    """YaRN's frequencies, in transformers' fp32 tensor ops and order: the extrapolated (plain) and interpolated
    (divided by factor) frequencies blended by a linear ramp between the correction dimensions."""
    import torch

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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
