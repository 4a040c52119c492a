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
    return model(config, state, device, kernels)
