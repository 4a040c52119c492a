"""Attention over the KV cache for the rows of one forward, as its plan divides them: exact
rows over exactly their own prefix; batched decode rows as a padded batched kernel computes
them (our kernel with chunks aligned to the batch, or the library's padded SDPA call)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import invariant, library
from . import triton as triton_kernels
from .choice import KernelChoice


@dataclass
class AttentionPlan:
    """How the rows of one forward attend. Row indices refer to the forward's rows.

    `exact`: each row attends over keys [0, its position] of its own slot (prompt rows,
    chunks, decode rows and verifier rows alike: one kernel, so they agree bitwise).
    `batched`: decode rows (one per request) attending as one padded batch: their bits depend
    on the batch (`fast`, LayerCast), as in the engines they stand for.
    """
    exact: list[int] = field(default_factory=list)
    batched: list[int] = field(default_factory=list)

    @classmethod
    def all_exact(cls, n: int) -> AttentionPlan:
        return cls(exact=list(range(n)))


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    """The batched rows as the library's one padded SDPA call reads them: cache slots [first_slot,
    end_slot) when they are consecutive (views, no copy), else gathered by `gather`."""
    rows: torch.Tensor  # their indices among the forward's rows
    first_slot: int
    end_slot: int
    gather: torch.Tensor | None  # their slots, when not consecutive
    padded_length: int  # the longest row's key count: every row's keys padded to it


class AttentionRows:
    """The plan as index tensors, built once per forward rather than once per layer.

    With our kernel every row goes in one call: exact rows lay their key chunks from position
    0, batched rows align theirs to the batch's longest row (`aligns`, as a padded batched
    kernel walks them). With the library's kernels (`KernelChoice.LIBRARY`), or Triton's (no aligned
    chunks), the batched rows instead share one padded SDPA
    call, and only then are its gather and row split built (and its key mask, once per sliding
    window, on first use)."""

    def __init__(self, plan: AttentionPlan, slots: torch.Tensor, positions: torch.Tensor,
                 kernel_choice: KernelChoice = KernelChoice.INVARIANT, triton: bool = False):
        dev = slots.device
        self.triton = triton  # exact rows through the Triton kernel
        self.slots, self.lengths = slots, positions + 1
        self.aligns = torch.zeros_like(positions)
        self.exact = self.batched = None
        if not plan.batched:
            return
        lengths = self.lengths[plan.batched]
        lmax = int(lengths.max())
        self.aligns[plan.batched] = lmax
        if kernel_choice is KernelChoice.INVARIANT and not triton:  # Triton's attention has no aligned chunks
            return
        if plan.exact:
            idx = torch.tensor(plan.exact, device=dev)
            self.exact = (idx, slots[idx], self.lengths[idx])
        rs = slots[plan.batched].tolist()
        consecutive = rs == list(range(rs[0], rs[0] + len(rs)))
        gather = None if consecutive else torch.tensor(rs, device=dev)
        self.batched = PaddedBatch(torch.tensor(plan.batched, device=dev), rs[0], rs[0] + len(rs), gather, lmax)
        self._batched_lengths = lengths
        self._masks: dict[int, torch.Tensor | None] = {}

    def mask(self, window: int) -> torch.Tensor | None:
        """The padded SDPA call's key mask for layers with this sliding window (0: none), built once."""
        if window not in self._masks:
            self._masks[window] = library.length_mask(self._batched_lengths, self.batched.padded_length, window)
        return self._masks[window]


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, rows: AttentionRows, dtype: torch.dtype,
           scale: float, window: int = 0) -> torch.Tensor:
    """q [N, heads, D] against one layer's cache K, V [slots, kv_heads, length, D], scores times
    `scale` (the model config's `attention_scale`); `window` > 0: each row sees only its last
    `window` keys (sliding-window layers). Rows built for the library kernels send their batched
    rows through one padded SDPA call, reading the cache in `dtype`."""
    if rows.batched is None:
        if rows.triton:
            return triton_kernels.attention(q, K, V, rows.slots, rows.lengths, scale, window)
        return invariant.attention(q, K, V, rows.slots, rows.lengths, scale, rows.aligns, window)
    out = torch.empty_like(q)
    if rows.exact is not None:
        idx, slots, lengths = rows.exact
        exact = triton_kernels.attention if rows.triton else invariant.attention
        out[idx] = exact(q[idx], K, V, slots, lengths, scale, window=window)
    b = rows.batched
    keys = slice(b.first_slot, b.end_slot) if b.gather is None else b.gather  # a slice: views, no copy
    kb, vb = K[keys, :, :b.padded_length], V[keys, :, :b.padded_length]
    if kb.dtype != dtype:
        kb, vb = kb.to(dtype), vb.to(dtype)
    out[b.rows] = library.batched_attention(q[b.rows], kb, vb, rows.mask(window), scale)
    return out
