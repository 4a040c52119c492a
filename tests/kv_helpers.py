"""KV pools laid out for tests that run a model directly: `count` requests of `length` positions, request r
on block table r, and their K/V read back as contiguous spans."""
from __future__ import annotations

import torch

from margingate.models.kv_cache import KVPool, blocks_for

DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def request_pool(config, count: int, length: int, dtype: torch.dtype | str = torch.bfloat16,
                 block: int = 16, device: str = "cpu") -> tuple[KVPool, torch.Tensor]:
    """A pool with `count` block tables of `length` positions ([count, W]): a forward's rows pass their
    request's index as `table_of`. `dtype`: a torch dtype (bf16, fp32) or a KV dtype name ("int8")."""
    pool = KVPool(config.num_layers, count * blocks_for(length, block), block, config.num_kv_heads,
                  config.head_dim, DTYPES.get(dtype, dtype), device)
    return pool, pool.tables_for(count, length)


def rows_of(index: int, n: int) -> torch.Tensor:
    """`table_of` for n rows of request `index`."""
    return torch.full((n,), index, dtype=torch.long)


def span(pool: KVPool, table: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of positions [start, end) of one block table: K, V [layers, kv_heads, end - start, head_dim]."""
    b = pool.block_size
    pos = torch.arange(start, end)
    blocks, rows = table[pos // b], pos % b
    # the two index tensors are not adjacent, so their dimension comes first: [n, layers, kv_heads, D]
    return (pool.k[:, blocks, :, rows].permute(1, 2, 0, 3).clone(),
            pool.v[:, blocks, :, rows].permute(1, 2, 0, 3).clone())
