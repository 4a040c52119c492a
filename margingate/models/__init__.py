"""Model configs, weights and forwards. `build_model` builds the decoder of an architecture."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig
    from .decoder import DecoderModel


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                kernels: str = "auto") -> DecoderModel:
    """The decoder of `config`'s architecture (its layer: `architectures.ARCHITECTURES`); `kernels`: the
    invariant kernels' backend (`decoder.resolve_kernels`)."""
    from .. import libc
    from .decoder import DecoderModel

    built = DecoderModel(config, state, device, kernels)
    libc.trim()  # the heap that decoding and repacking the weights freed (114 MB of a 1B Q8_0 load)
    return built

