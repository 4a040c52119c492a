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
    from .decoder import DecoderModel

    built = DecoderModel(config, state, device, kernels)
    _return_freed_heap()
    return built


def _return_freed_heap() -> None:
    """Give the OS back the heap that decoding and repacking the weights freed (glibc keeps it otherwise:
    114 MB of a 1B Q8_0 load's resident memory). Where the C library has no malloc_trim, nothing."""
    import ctypes

    from .. import libc

    trim = libc.function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is not None:
        trim(0)
