"""Model configs, weights and forwards. `build_model` picks the forward for an architecture."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .config import ModelConfig
    from .llama import LlamaModel


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: str = "cpu",
                kernels: str = "auto") -> LlamaModel:
    """Gemma 3's forward for Gemma3ForCausalLM, the Llama family's for the others; `kernels`: the
    invariant kernels' backend (`llama.resolve_kernels`)."""
    from .gemma3 import Gemma3Model
    from .llama import LlamaModel

    model = Gemma3Model if config.architecture == "Gemma3ForCausalLM" else LlamaModel
    built = model(config, state, device, kernels)
    _return_freed_heap()
    return built


def _return_freed_heap() -> None:
    """Give the OS back the heap that decoding and repacking the weights freed (glibc keeps it otherwise:
    114 MB of a 1B Q8_0 load's resident memory). Where the C library has no malloc_trim, nothing."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
