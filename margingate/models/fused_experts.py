"""gpt-oss's experts as its checkpoints store them, split into one set of matrices per expert.

transformers' `GptOssExperts` keeps every expert of a layer in four tensors: `gate_up_proj` [E, hidden, 2I]
(transposed, the gate and up columns interleaved: gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...),
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, hidden] (transposed) and `down_proj_bias` [E, hidden]. The
name map (`weights.py`) reads experts one by one under `mlp.experts.{e}.{gate_proj,up_proj,down_proj}`, as
Mixtral's and Qwen3-MoE's checkpoints hold them, so a gpt-oss state is given those names here: each expert's
gate and up rows de-interleaved (each output column is its own dot product, so reordering columns changes no
bit), its matrices transposed to [out, in], its biases split alike. Nothing else is touched. The GGUF export
reads a folder through the same names (`pieces`).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from .architectures import ARCHITECTURES
from .config import ModelConfig

FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _gate(t: torch.Tensor) -> torch.Tensor:
    return t[..., 0::2].t() if t.dim() == 2 else t[0::2]


def _up(t: torch.Tensor) -> torch.Tensor:
    return t[..., 1::2].t() if t.dim() == 2 else t[1::2]


def _down(t: torch.Tensor) -> torch.Tensor:
    return t.t() if t.dim() == 2 else t


def pieces(config: ModelConfig, names) -> dict[str, tuple[str, int, Callable]]:
    """Per-expert name -> (the fused tensor it is cut from, its expert, the cut of that expert's slice), for the
    layers of `names` (a state's tensor names) that hold gpt-oss's fused experts; {} for any other model."""
    moe = ARCHITECTURES[config.architecture].moe
    if moe is None or not moe.gpt_oss:
        return {}
    names, out = set(names), {}
    for i in config.moe_layers:
        base = f"model.layers.{i}.{moe.experts}"
        if not all(f"{base}.{k}" in names for k in FUSED):
            continue
        for e in range(config.num_experts):
            for module, cut, fused in ((moe.gate, _gate, "gate_up_proj"), (moe.up, _up, "gate_up_proj"),
                                       (moe.down, _down, "down_proj")):
                out[f"{base}.{e}.{module}.weight"] = (f"{base}.{fused}", e, cut)
                out[f"{base}.{e}.{module}.bias"] = (f"{base}.{fused}_bias", e, cut)
    return out


def split(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every layer's fused experts replaced by per-expert tensors (a copy; `state` itself, with its
    attributes, where the architecture does not fuse or the tensors are already split). Fused tensors whose
    shapes do not fit the config are cut as they come, for the name map to refuse the pieces by name."""
    cuts = pieces(config, state.keys())
    if not cuts:
        return state
    for fused in {f for f, _, _ in cuts.values()}:
        if state[fused].shape[0] != config.num_experts:
            raise ValueError(f"{fused} holds {state[fused].shape[0]} experts; config.json says {config.num_experts}")
    out = copy.copy(state)  # a Checkpoint keeps its source, contract and packed cache
    for name, (fused, e, cut) in cuts.items():
        out[name] = cut(state[fused][e]).contiguous()
    for fused in {f for f, _, _ in cuts.values()}:
        del out[fused]
    return out
