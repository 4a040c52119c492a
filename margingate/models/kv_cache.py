"""Slot-based KV cache: one fixed-length row per running request.

Positions are absolute, so rolling a request back is just lowering its length
(the stale columns are overwritten by the next writes and never read: attention
only ever looks at positions below a row's current length).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Column = tuple[torch.Tensor, torch.Tensor]  # one position's K and V, every layer: [layers, kv_heads, head_dim]


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        # zeros, not empty: masked positions still enter the batched attention as 0 * v.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot

    # --- slots ----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot")  # the scheduler checks num_free first
        return self._free.pop()

    def view(self, slot: int) -> SlotView:
        return SlotView(self, slot)

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)

    # --- writes ---------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim] for N (slot, position) pairs."""
        self.k[layer, slots, :, positions] = k.to(self.k.dtype)
        self.v[layer, slots, :, positions] = v.to(self.v.dtype)

    # --- a span: positions [start, end) of one request, every layer ------------------
    def read_span(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies: [layers, kv_heads, end - start, head_dim] each (the prefix cache keeps them)."""
        return self.k[:, slot, :, start:end].clone(), self.v[:, slot, :, start:end].clone()

    def write_span(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[2]
        self.k[:, slot, :, start:end] = k
        self.v[:, slot, :, start:end] = v

    def copy_span(self, src: int, dst: int, start: int, end: int) -> None:
        """Positions [start, end) of slot `src` into slot `dst` (a fork: n samples of one prompt)."""
        self.k[:, dst, :, start:end] = self.k[:, src, :, start:end]
        self.v[:, dst, :, start:end] = self.v[:, src, :, start:end]

    # --- one column: one position of one request, every layer ------------------
    def read_column(self, slot: int, pos: int) -> Column:
        return self.k[:, slot, :, pos].clone(), self.v[:, slot, :, pos].clone()

    def write_column(self, slot: int, pos: int, column: Column) -> None:
        self.k[:, slot, :, pos] = column[0]
        self.v[:, slot, :, pos] = column[1]


@dataclass(frozen=True, slots=True)
class SlotView:
    """One request's slot, all a policy may do to the cache: read a position's column (a copy)
    and overwrite it. Rolling back needs no cache write (see the module docstring)."""
    kv: KVCache
    slot: int

    def read(self, pos: int) -> Column:
        return self.kv.read_column(self.slot, pos)

    def overwrite(self, pos: int, column: Column) -> None:
        self.kv.write_column(self.slot, pos, column)
