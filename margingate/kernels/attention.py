"""Attention over the KV cache for the rows of one forward, as its plan divides them: exact
rows over exactly their own prefix; batched decode rows as a padded batched kernel computes
them (our kernel with chunks aligned to the batch, or the library's padded SDPA call)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import invariant, library
from . import triton as triton_kernels
from .choice import KernelChoice
from .kv_format import LayerKV, dequantize


@dataclass
class AttentionPlan:
    """How the rows of one forward attend. Row indices refer to the forward's rows.

    `exact`: each row attends over keys [0, its position] of its own request (prompt rows,
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
    """The batched rows as the library's one padded SDPA call reads them: their keys gathered from their
    block tables into [rows, kv_heads, padded_length, D]."""
    rows: torch.Tensor  # their indices among the forward's rows
    tables: torch.Tensor  # their block tables [rows, W]
    padded_length: int  # the longest row's key count: every row's keys padded to it


class AttentionRows:
    """The plan as index tensors, built once per forward rather than once per layer.

    Row r's keys lie in its request's block table, tables[table_of[r]] (models/kv_cache.py). With our
    kernel every row goes in one call: exact rows lay their key chunks from position 0, batched rows
    align theirs to the batch's longest row (`aligns`, as a padded batched kernel walks them). With the
    library's kernels (`KernelChoice.LIBRARY`) on CPU the batched rows instead share one padded SDPA call,
    and only then are its gather and row split built (and its key mask, once per sliding window, on first
    use). On the Triton backend every row, batched or exact, goes through its paged kernel (which has no
    aligned chunks), as vLLM's decode reads its paged cache with its own kernel."""

    def __init__(self, plan: AttentionPlan, tables: torch.Tensor, table_of: torch.Tensor, positions: torch.Tensor,
                 kernel_choice: KernelChoice = KernelChoice.INVARIANT, triton: bool = False):
        dev = positions.device
        self.triton = triton  # every row through the Triton kernel
        self.tables, self.table_of, self.positions = tables, table_of, positions
        self.lengths = positions + 1
        self.aligns = torch.zeros_like(positions)
        self.exact = self.batched = None
        # Triton's paged kernel reads batched rows' keys in place too: no gather, no host sync (CUDA graphs)
        if not plan.batched or triton:
            return
        lengths = self.lengths[plan.batched]
        lmax = int(lengths.max())
        self.aligns[plan.batched] = lmax
        if kernel_choice is KernelChoice.INVARIANT:
            return
        if plan.exact:
            idx = torch.tensor(plan.exact, device=dev)
            self.exact = (idx, table_of[idx], self.lengths[idx])
        rows = torch.tensor(plan.batched, device=dev)
        self.batched = PaddedBatch(rows, tables[table_of[rows]], lmax)
        self._batched_lengths = lengths
        self._masks: dict[int, torch.Tensor | None] = {}

    def mask(self, window: int) -> torch.Tensor | None:
        """The padded SDPA call's key mask for layers with this sliding window (0: none), built once."""
        if window not in self._masks:
            self._masks[window] = library.length_mask(self._batched_lengths, self.batched.padded_length, window)
        return self._masks[window]


def gather_padded(cache: torch.Tensor, scales: torch.Tensor, rotated: bool, tables: torch.Tensor, length: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """The first `length` keys (or values) of each table's rows from one layer's paged cache [blocks, kv_heads,
    B, width], as [rows, kv_heads, length, D] in `dtype` (a quantized cache dequantized, and taken back to the
    plain basis where it is stored rotated: kv_format.dequantize)."""
    bs = cache.shape[2]
    idx = tables[:, :-(-length // bs)].clamp(min=0)  # -1 pads a short table: those keys are masked
    x = cache[idx]  # [rows, blocks, kv_heads, B, width]
    if scales.numel():
        x = dequantize(x, scales[idx], unrotate=rotated)
    x = x.permute(0, 2, 1, 3, 4).reshape(x.shape[0], x.shape[2], -1, x.shape[4])[:, :, :length]
    return x.to(dtype)


def attend(q: torch.Tensor, kv: LayerKV, rows: AttentionRows, dtype: torch.dtype, scale: float,
           window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, heads, D] against one layer's paged cache `kv` (invariant.LayerKV), scores times `scale` (the
    model config's `attention_scale`); `window` > 0: each row sees only its last `window` keys (sliding-window
    layers); `sinks` [heads]: gpt-oss's attention sinks (a logit per head in the softmax's denominator,
    csrc/contract.h 3). Rows built for the library kernels send their batched rows through one padded call,
    reading the cache in `dtype`."""
    if rows.batched is None:
        if rows.triton:
            return triton_kernels.attention(q, kv, rows.tables, rows.table_of, rows.lengths, scale, window, sinks)
        return invariant.attention(q, kv, rows.tables, rows.table_of, rows.lengths, scale, rows.aligns, window, sinks)
    out = torch.empty_like(q)
    if rows.exact is not None:
        idx, table_of, lengths = rows.exact
        exact = triton_kernels.attention if rows.triton else invariant.attention
        out[idx] = exact(q[idx], kv, rows.tables, table_of, lengths, scale, window=window, sinks=sinks)
    b = rows.batched
    kb = gather_padded(kv.k, kv.k_scale, kv.rotate, b.tables, b.padded_length, dtype)
    vb = gather_padded(kv.v, kv.v_scale, kv.rotate, b.tables, b.padded_length, dtype)
    out[b.rows] = library.batched_attention(q[b.rows], kb, vb, rows.mask(window), scale, sinks)
    return out
