"""Sizing the KV pool: how many blocks an engine gets, and the context that leaves its requests.

`--kv-cache-memory` GB, or by default a share of the memory available when the engine starts (at most what
`max_num_seqs` requests at the full context would use): the host's MemAvailable, or on a GPU its free memory
once the weights are loaded (half of it: activations and recorded graphs need the rest). On the host the pool
is reserved, not touched: a block's pages become resident when it is first handed out, so an idle engine's
resident memory does not grow with it.
"""
from __future__ import annotations

import torch

from ..kernels.kv_format import KV_FORMATS
from ..models.config import ModelConfig
from ..models.decoder import DecoderModel
from ..models.kv_cache import KVPool, blocks_for
from ..options.engine import EngineConfig

DEFAULT_MEMORY_SHARE = 0.4   # of MemAvailable at start
DEVICE_MEMORY_SHARE = 0.5    # of a GPU's free memory at start
SINK_BLOCKS = 1  # held by the runner for the dummy rows of fixed-shape verifier passes (runner.py)


def available_bytes(device: torch.device | None = None) -> int:
    """What the pool may take by default: a share of a GPU's free memory, or of the host's MemAvailable from
    /proc/meminfo (Linux; 8 GiB where it cannot be read)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * DEVICE_MEMORY_SHARE)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * DEFAULT_MEMORY_SHARE)
    except OSError:
        pass
    return int((8 << 30) * DEFAULT_MEMORY_SHARE)


def bytes_per_position(config: ModelConfig, kv_dtype: str) -> int:
    """K and V of one position, every layer (quantized: codes and an fp32 scale per group)."""
    per_head = KV_FORMATS[kv_dtype].bytes_per_head(config.head_dim)
    return 2 * config.num_layers * config.num_kv_heads * per_head


def requested_context(model_config: ModelConfig, config: EngineConfig) -> int:
    """The context asked for: --max-model-len, else the model's own, never beyond the model's."""
    return min(config.max_model_len or model_config.max_position, model_config.max_position)


def pool_blocks(model_config: ModelConfig, config: EngineConfig, device: torch.device | None = None) -> int:
    per_block = bytes_per_position(model_config, config.kv_cache_dtype) * config.kv_block_size
    if config.kv_cache_memory is not None:
        blocks = int(config.kv_cache_memory * 1e9) // per_block
        if blocks < 2:
            raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} GB holds {blocks} blocks of "
                             f"{config.kv_block_size} positions ({per_block} bytes each): too small for one request")
        return blocks
    per_request = blocks_for(requested_context(model_config, config), config.kv_block_size)
    needed = config.max_num_seqs * per_request + SINK_BLOCKS
    return max(2, min(needed, available_bytes(device) // per_block))


def build_pool(model: DecoderModel, config: EngineConfig) -> KVPool:
    mc = model.config
    return KVPool(mc.num_layers, pool_blocks(mc, config, model.device), config.kv_block_size, mc.num_kv_heads,
                  mc.head_dim, config.kv_cache_dtype, model.device)


def context_length(model_config: ModelConfig, config: EngineConfig, pool: KVPool) -> int:
    """Positions one request may reach: the model's trained context (or --max-model-len), within what the pool
    holds beside the runner's sink block."""
    return max(2, min(requested_context(model_config, config), (pool.num_blocks - SINK_BLOCKS) * pool.block_size))
