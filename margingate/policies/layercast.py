"""`layercast` (Yuan et al.): BF16 weights, FP32 compute.

The decode forward of these requests runs in fp32 (weights are upcast from
bf16 once and kept, which is numerically the same as upcasting at each use);
the KV cache stays bf16. Wider accumulators make flips rarer, not impossible:
the padded batched attention still changes the reduction order.
"""
import torch

from ..engine.policy import Policy
from ..kernels.choice import KernelChoice


class LayerCastPolicy(Policy):
    name = "layercast"
    compute_dtype = torch.float32
    kernel_choice = KernelChoice.LIBRARY  # Yuan et al.'s fp32 GEMMs, as PyTorch computes them
    speculates = True
