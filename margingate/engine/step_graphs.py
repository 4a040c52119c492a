"""Forwards of a fixed shape, recorded once per shape and replayed: CUDA graphs, or their CPU stand-in.

On a GPU a decode step of a small batch is bound by launches, not by the GPU: a few hundred kernels, each
started from Python. A captured graph launches them all at once. A graph fixes every tensor's shape and
address, so a forward is padded up to a bucket of rows (1, 2, 4, 8, then multiples of 8 to 64, then of
64), as vLLM and SGLang do, and reads its inputs from static buffers:

- tokens and positions: a padding row feeds token 0 at position 0;
- block tables: one row per request, `max_blocks` wide (entries past a request's end are stale and never
  read: attention reads a row's table only below its length), plus one last row holding the runner's
  sink block, which every padding row reads and writes;
- each row's table and the logits of every row come back (the caller picks the rows it wants, a copy, so
  the next replay may reuse the graph's memory).

Padding never changes a real row's bits: every kernel computes a row from its own inputs (the invariant
kernels by construction; cuBLAS's choice of kernel is fixed by the bucket's shape, which is why `fast`
promises nothing), and a padding row's K/V land in the sink block, which no request reads.

`capture=False` is the stand-in, on CPU or wherever graphs are not wanted: the same buckets, buffers and
Python forward, run eagerly at every call. Tests run it to show the padding keeps every bit.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels.attention import AttentionPlan
from ..kernels.choice import KernelChoice
from ..models.decoder import DecoderModel
from ..models.kv_cache import KVPool

GraphKey = tuple[int, bool, torch.dtype, KernelChoice]  # rows bucket, exact attention, activations, kernels


def buckets(max_rows: int) -> list[int]:
    """The row counts forwards are padded to: 1, 2, 4, 8, 16, ..., 64 (by 8), then by 64, the last >= max_rows."""
    sizes = [1, 2, 4, *range(8, 65, 8)]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] + 64)
    return [s for s in sizes if s < max_rows] + [next(s for s in sizes if s >= max_rows)]


@dataclass
class _Buffers:
    """A shape's static inputs and its output."""
    tokens: torch.Tensor     # [R]
    positions: torch.Tensor  # [R]
    tables: torch.Tensor     # [R + 1, max_blocks]: the last row is the sink's
    table_of: torch.Tensor   # [R]
    logits: torch.Tensor | None = None  # [R, vocab] fp32, written by each run

    def load(self, tokens: list[int], positions: list[int], tables: torch.Tensor, table_of: list[int]) -> None:
        n, (t, w) = len(tokens), tables.shape
        sink = self.tables.shape[0] - 1
        host = torch.tensor([tokens + [0] * (len(self.tokens) - n), positions + [0] * (len(self.tokens) - n),
                             table_of + [sink] * (len(self.tokens) - n)], dtype=torch.long)
        self.tokens.copy_(host[0], non_blocking=True)
        self.positions.copy_(host[1], non_blocking=True)
        self.table_of.copy_(host[2], non_blocking=True)
        self.tables[:t, :w].copy_(tables, non_blocking=True)


class StepGraphs:
    def __init__(self, model: DecoderModel, kv: KVPool, sink: int, max_blocks: int, max_rows: int, capture: bool):
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs capture forwards on a CUDA device, not on {model.device} "
                             f"(the stand-in, capture=False, runs anywhere)")
        self.model, self.kv, self.sink, self.max_blocks = model, kv, sink, max_blocks
        model.reserve_positions(max_blocks * kv.block_size)
        self.capture = capture
        self.sizes = buckets(max_rows)
        self._runs: dict[GraphKey, tuple[_Buffers, Callable[[], None]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def forget(self) -> None:
        """Drop every recorded forward: each captured the weights it ran with (`Runner.weights_changed`)."""
        self._runs.clear()

    def takes(self, rows: int) -> bool:
        """Does a forward of this many rows fit a bucket? (MoE routing reads the batch on the host: never.)"""
        return rows <= self.sizes[-1] and not self.model.config.num_experts

    def forward(self, tokens: list[int], positions: list[int], tables: torch.Tensor, table_of: list[int],
                exact: bool, dtype: torch.dtype, kernel_choice: KernelChoice) -> torch.Tensor:
        """The logits [len(tokens), vocab] of a forward whose rows all attend one way (`exact`, or as one
        batch), run as its bucket's recorded forward; its buffers are reused by the next call."""
        size = next(s for s in self.sizes if s >= len(tokens))
        key = (size, exact, dtype, kernel_choice)
        if key not in self._runs:
            self._runs[key] = self._record(key, tokens, positions, tables, table_of)
        else:
            buffers, replay = self._runs[key]
            buffers.load(tokens, positions, tables, table_of)
            replay()
        return self._runs[key][0].logits[:len(tokens)]

    def _record(self, key: GraphKey, tokens, positions, tables, table_of) -> tuple[_Buffers, Callable[[], None]]:
        """A new bucket's buffers (loaded with this call's inputs) and how to run it again; runs it once."""
        size, exact, dtype, kernel_choice = key
        dev = self.model.device
        buffers = _Buffers(*(torch.zeros(size, dtype=torch.long, device=dev) for _ in range(2)),
                           torch.full((size + 1, self.max_blocks), -1, dtype=torch.long, device=dev),
                           torch.zeros(size, dtype=torch.long, device=dev))
        buffers.tables[size, 0] = self.sink
        plan = AttentionPlan(exact=list(range(size))) if exact else AttentionPlan(batched=list(range(size)))
        buffers.load(tokens, positions, tables, table_of)

        def run() -> torch.Tensor:
            return self.model.forward(buffers.tokens, buffers.positions, buffers.tables, buffers.table_of, plan,
                                      self.kv, dtype=dtype, kernel_choice=kernel_choice)

        if not self.capture:
            def eager() -> None:
                buffers.logits = run()
            eager()
            return buffers, eager
        # the first run outside the graph: Triton compiles, cuBLAS picks its kernels, the allocator warms up
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            buffers.logits = run()
        graph.replay()  # the capture ran nothing: this call's rows
        return buffers, graph.replay

    @property
    def recorded(self) -> int:
        """How many shapes have been recorded (captured) so far."""
        return len(self._runs)
