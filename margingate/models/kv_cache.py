"""The KV cache: one pool of fixed-size blocks per model, and a block table per request.

K and V live in blocks of `block_size` positions, [layers, blocks, kv_heads, block_size, head_dim]
(`int8` / `int4`: each position's heads rotated and quantized by themselves, codes plus an fp32 scale per group
of 32 values: kernels/kv_format.py). A request's `BlockTable`
lists its blocks in position order: position p lies in row p % block_size of block blocks[p //
block_size]. The kernels read keys through the table in logical position order, so where a block
lies and who else holds it change no bit (`csrc/contract.h`, 6).

Blocks are allocated as tokens arrive and reference-counted: the prefix cache and the n samples of one
prompt share a prompt's blocks instead of copying them, and a write into a shared block copies it
first (`BlockTable.prepare`). Positions are absolute, so rolling a request back only frees the blocks
past its new length; stale rows below it are overwritten by the next writes and never read, as
attention only looks at positions below a row's length.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import libc
from ..kernels import invariant
from ..kernels.kv_format import KV_FORMATS, LayerKV

Column = tuple[torch.Tensor, torch.Tensor]  # one position's K and V, every layer: [layers, kv_heads, head_dim]


MADV_DONTNEED = 4  # Linux: the pages are dropped; the next read of them finds zeros
PAGE = mmap.PAGESIZE


def release_pages(addr: int, length: int) -> int:
    """Drop the whole pages inside [addr, addr + length); the bytes dropped (0 where madvise is missing)."""
    start, end = -(-addr // PAGE) * PAGE, (addr + length) // PAGE * PAGE
    fn = libc.function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    if fn is None or end <= start or sys.platform != "linux":
        return 0
    return end - start if fn(start, end - start, MADV_DONTNEED) == 0 else 0


class PoolExhausted(RuntimeError):
    """No free block (the scheduler preempts a request and tries again)."""


class BlockRefError(RuntimeError):
    """A block released with no reference left, or shared while free: a bookkeeping bug, never memory pressure."""


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str = "bfloat16", device: torch.device | str = "cpu"):
        if dtype not in KV_FORMATS:
            raise ValueError(f"KV cache dtype must be one of {', '.join(KV_FORMATS)}, got {dtype!r}")
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool: need at least one block of at least one position, "
                             f"got {num_blocks} x {block_size}")
        fmt = self.format = KV_FORMATS[dtype]
        shape = (num_layers, num_blocks, num_kv_heads, block_size, fmt.width(head_dim))
        self.dtype, self.block_size, self.num_blocks = dtype, block_size, num_blocks
        # empty, not zeros: a block's pages become resident when it is first handed out (and zeroed then)
        self.k = torch.empty(shape, dtype=fmt.storage, device=device)
        self.v = torch.empty(shape, dtype=fmt.storage, device=device)
        scales = (*shape[:4], head_dim // fmt.group_for(head_dim)) if fmt.quantized else (0,)
        self.k_scale = torch.empty(scales, dtype=torch.float32, device=device)
        self.v_scale = torch.empty(scales, dtype=torch.float32, device=device)
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest, then the latest freed
        # frees one block that only the prefix cache holds, if any (prefix_cache.py sets it); None: no cache
        self.reclaim: Callable[[], bool] | None = None

    @property
    def quantized(self) -> bool:
        return self.format.quantized

    @property
    def rotate(self) -> bool:
        """Are the values stored in the Hadamard basis (a quantized format's; the kernels undo it)?"""
        return self.format.rotate

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_block(self) -> int:
        scales = self.k_scale[:, 0].numel() * 4 if self.quantized else 0
        return 2 * (self.k[:, 0].numel() * self.k.element_size() + scales)

    def tensors(self) -> list[torch.Tensor]:
        """[k, v, k_scale, v_scale] (scales empty unless quantized): the compiled stack's view of the cache (with
        `rotate`)."""
        return [self.k, self.v, self.k_scale, self.v_scale]

    def layer(self, li: int) -> LayerKV:
        """One layer's K, V [blocks, kv_heads, block_size, width] and their scales (empty unless quantized)."""
        if self.quantized:
            return LayerKV(self.k[li], self.v[li], self.k_scale[li], self.v_scale[li], self.rotate)
        return LayerKV(self.k[li], self.v[li], self.k_scale, self.v_scale)

    def write(self, li: int, tables: torch.Tensor, table_of: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows' K and V [N, kv_heads, head_dim] into layer `li` at their positions of their block tables: the
        compiled write for a bf16 or quantized cache on CPU (the stack's own, so both paths leave the same bytes),
        indexing elsewhere (an fp32 cache keeps fp32 rows)."""
        if self.k.device.type == "cpu" and self.dtype != "float32":
            invariant.kv_write(self.layer(li), k.to(torch.bfloat16), v.to(torch.bfloat16), tables, table_of,
                               positions)
            return
        if self.quantized:
            raise ValueError(f"an {self.dtype} KV cache is written by the compiled CPU kernels only")
        blocks, rows = tables[table_of, positions // self.block_size], positions % self.block_size
        self.k[li][blocks, :, rows] = k.to(self.k.dtype)
        self.v[li][blocks, :, rows] = v.to(self.v.dtype)

    # --- blocks -------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free and not (self.reclaim is not None and self.reclaim()):
            raise PoolExhausted(f"the KV pool's {self.num_blocks} blocks are all in use")
        block = self._free.pop()
        self.refs[block] = 1
        # finite values everywhere: the library's padded attention multiplies masked rows by 0
        for t in self._per_block():
            t[:, block].zero_()
        return block

    def release_free_pages(self) -> int:
        """Hand back to the system the memory pages lying wholly inside free blocks (an idle server, on its engine
        thread: no forward runs meanwhile). `allocate` zeroes a block when it hands it out, so what such a page
        reads afterwards is never seen. A CPU pool only; the bytes advised away."""
        if self.k.device.type != "cpu" or not self._free:
            return 0
        free, runs = sorted(self._free), []
        for b in free:  # runs of consecutive free blocks [a, b)
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + 1
            else:
                runs.append([b, b + 1])
        released = 0
        for t in self._per_block():  # [layers, blocks, ...]: each layer's blocks are one slab
            block = t[0, 0].numel() * t.element_size()
            for layer in range(t.shape[0]):
                base = t[layer].data_ptr()
                released += sum(release_pages(base + a * block, (b - a) * block) for a, b in runs)
        return released

    def _per_block(self) -> tuple[torch.Tensor, ...]:
        return (self.k, self.v, self.k_scale, self.v_scale) if self.quantized else (self.k, self.v)

    def tables_for(self, count: int, length: int) -> torch.Tensor:
        """`count` block tables of `length` positions each, on fresh blocks, as the kernels take them ([count, W]):
        for callers that run the model directly (tests, scripts), with table r standing for request r."""
        width = blocks_for(length, self.block_size)
        return torch.tensor([[self.allocate() for _ in range(width)] for _ in range(count)], dtype=torch.long,
                            device=self.k.device)

    def retain(self, block: int) -> None:
        if self.refs[block] < 1:  # a free block shared: the next allocate would hand it to a second owner
            raise BlockRefError(f"KV block {block} is free: it cannot be shared")
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; the last puts the block back on the free list. A release with no reference left
        is a double free: the block would land on the free list twice and two requests would later share it
        silently (each writing the other's K/V), so it raises instead."""
        if self.refs[block] < 1:
            raise BlockRefError(f"KV block {block} released twice (it holds no reference): a double free")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def copy_block(self, src: int, dst: int) -> None:
        for t in self._per_block():
            t[:, dst] = t[:, src]


@dataclass(eq=False)
class BlockTable:
    """One request's blocks, in position order; all a policy may do to its cache is read a position's column
    (a copy) and overwrite it."""
    pool: KVPool
    blocks: list[int]

    @classmethod
    def empty(cls, pool: KVPool) -> BlockTable:
        return cls(pool, [])

    def locate(self, pos: int) -> tuple[int, int]:
        b = self.pool.block_size
        return self.blocks[pos // b], pos % b

    def prepare(self, start: int, end: int) -> None:
        """Positions [start, end) made writable: blocks allocated up to `end`, any shared among them copied
        first. Raises PoolExhausted (having kept what it got) when the pool runs out."""
        b = self.pool.block_size
        while len(self.blocks) * b < end:
            self.blocks.append(self.pool.allocate())
        for i in range(start // b, blocks_for(end, b)):
            old = self.blocks[i]
            if self.pool.refs[old] > 1:
                new = self.pool.allocate()
                self.pool.copy_block(old, new)
                self.pool.release(old)
                self.blocks[i] = new

    def share(self, other: BlockTable, length: int) -> None:
        """Hold `other`'s blocks for positions [0, length) as well (a fork of its prompt)."""
        for block in other.blocks[:blocks_for(length, self.pool.block_size)]:
            self.append_shared(block)

    def append_shared(self, block: int) -> None:
        self.pool.retain(block)
        self.blocks.append(block)

    def truncate(self, length: int) -> None:
        """Free the blocks past position `length` - 1."""
        keep = blocks_for(length, self.pool.block_size)
        for block in self.blocks[keep:]:
            self.pool.release(block)
        del self.blocks[keep:]

    def free(self) -> None:
        self.truncate(0)

    def read(self, pos: int) -> Column:
        """A copy of position `pos`'s K and V, every layer (quantized: its codes, then its scales, as fp32)."""
        block, row = self.locate(pos)
        p = self.pool
        if p.quantized:
            return (torch.cat([p.k[:, block, :, row].float(), p.k_scale[:, block, :, row]], -1),
                    torch.cat([p.v[:, block, :, row].float(), p.v_scale[:, block, :, row]], -1))
        return p.k[:, block, :, row].clone(), p.v[:, block, :, row].clone()

    def overwrite(self, pos: int, column: Column) -> None:
        self.prepare(pos, pos + 1)
        block, row = self.locate(pos)
        p = self.pool
        if p.quantized:
            w = p.k.shape[-1]
            (k, ks), (v, vs) = ((c[..., :w], c[..., w:]) for c in column)
            p.k[:, block, :, row], p.k_scale[:, block, :, row] = k.to(p.k.dtype), ks
            p.v[:, block, :, row], p.v_scale[:, block, :, row] = v.to(p.v.dtype), vs
            return
        p.k[:, block, :, row], p.v[:, block, :, row] = column
