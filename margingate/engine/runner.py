"""Turns spans of sequences into model forwards (rows, positions, block tables, plan).

A forward is a list of spans: consecutive positions of one request fed in one go
(a prompt chunk, one decode position, a verifier window: `verifier.py` builds those).
Each span's rows attend over exactly their own prefix (the invariant kernel) unless they
are a decode row whose policy takes the batched fast path, and the forward runs our
invariant Linear/norm kernels unless every span's `KernelChoice` is the library's (prompt
chunks and verifier windows never are).

A forward of few rows that attend one way may run as its bucket's recorded forward (`step_graphs.py`:
CUDA graphs on a GPU). On a GPU the logits stay there and only each row's argmax and margin come back
(`device_rows.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.choice import KernelChoice
from ..models.decoder import AttentionPlan, DecoderModel
from ..models.kv_cache import BlockTable, KVPool, PoolExhausted, blocks_for
from .device_rows import DeviceRows
from .sequence import Sequence
from .step_graphs import StepGraphs


@dataclass(frozen=True, slots=True)
class Span:
    """Positions [start, end) of `seq`, fed in one forward; the logits of its last `logits_rows` rows
    come back."""
    seq: Sequence | None          # None: dummy rows on the runner's sink block (fixed-shape padding)
    start: int
    end: int
    exact_attention: bool         # attend over exactly its own prefix (else: the padded batched call)
    kernel_choice: KernelChoice   # the Linear/norm kernels its rows need
    logits_rows: int = 1
    # proposals fed after the sequence's own tokens (speculation): the span's last len(drafts) positions,
    # which are not the sequence's until accepted
    drafts: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return self.end - self.start


class Runner:
    def __init__(self, model: DecoderModel, kv: KVPool, *, graphs: str = "off", max_len: int = 0,
                 graph_rows: int = 512, on_device: bool | None = None):
        """`graphs`: `cuda` (capture CUDA graphs), `stand-in` (the same buckets run eagerly) or `off`, for forwards
        of up to `graph_rows` rows over requests of up to `max_len` positions. `on_device`: leave logits rows on
        the device (`DeviceRows`); by default on a GPU."""
        self.model, self.kv, self.device = model, kv, model.device
        # where the dummy rows of padded verifier passes write and read: every position in one block, held for
        # good (their results are thrown away; only the pass's shape counts)
        self.sink = kv.allocate()
        self.on_device = model.device.type == "cuda" if on_device is None else on_device
        self.graphs = None
        if graphs != "off":  # tables as wide as a request's context, or as a pass's padding span (sink positions)
            self.graphs = StepGraphs(model, kv, self.sink, blocks_for(max(max_len, graph_rows), kv.block_size),
                                     graph_rows, capture=graphs == "cuda")

    def weights_changed(self) -> None:
        """The model's weights were replaced: recorded forwards are recorded again on first use."""
        if self.graphs is not None:
            self.graphs.forget()

    def step(self, prefills: list[tuple[Sequence, int, int]], decodes: list[Sequence]) -> list[torch.Tensor | None]:
        """One engine step: prompt chunks (seq, start, end) and one decode row per sequence.
        Returns, in that order, fp32 logits rows [n, vocab] for each: a prompt chunk's last row if
        it ends the prompt (else None), or all its rows if the request wants prompt logprobs;
        each decode row's. Decode rows whose policy computes in another dtype (LayerCast) run in
        their own forward."""
        # Prompts always go through the invariant kernels: a prompt's K/V is then the same
        # whatever else is prefilled beside it, in whatever chunks (the ground for replay).
        spans = [Span(s, a, b, exact_attention=True, kernel_choice=KernelChoice.INVARIANT,
                      logits_rows=s.prefill_logits_rows(a, b)) for s, a, b in prefills]
        spans += [self._decode_span(s) for s in decodes]
        dtypes = [torch.bfloat16] * len(prefills) + [s.policy.compute_dtype for s in decodes]
        out: list[torch.Tensor | None] = [None] * len(spans)
        for dtype in dict.fromkeys(dtypes):
            idx = [i for i, d in enumerate(dtypes) if d == dtype]
            part = [spans[i] for i in idx]
            for i, logits in zip(idx, self.forward(part, dtype, shared_choice(part))):
                out[i] = logits
        return out

    def _decode_span(self, seq: Sequence) -> Span:
        """A request's decode rows: [last token] or, speculating, [last token, d1..dk] (exact attention,
        so each row is the row of decoding its position alone). A row that need not be exact takes the
        faster kernel set here: ours on CPU, the library's on CUDA (`DecoderModel.invariant_is_fastest`)."""
        drafts = tuple(seq.drafts)
        exact = seq.policy.exact_attention or bool(drafts)
        ours = seq.policy.kernel_choice is KernelChoice.INVARIANT and (exact or self.model.invariant_is_fastest)
        return Span(seq, seq.last_fed_pos, seq.next_pos + len(drafts), exact_attention=exact,
                    kernel_choice=KernelChoice.INVARIANT if ours else KernelChoice.LIBRARY,
                    logits_rows=len(drafts) + 1, drafts=drafts)

    def forward(self, spans: list[Span], dtype: torch.dtype,
                kernel_choice: KernelChoice) -> list[torch.Tensor | DeviceRows | None]:
        """One forward over the spans; each span's wanted logits rows, or None."""
        tokens, positions, exact, batched, wanted = [], [], [], [], []
        tables, table_of = self._tables(spans)
        for span in spans:
            first = len(tokens)
            if span.seq is None:
                tokens += [0] * span.rows
            else:
                tokens += span.seq.tokens(span.start, span.end - len(span.drafts)) + list(span.drafts)
            positions += range(span.start, span.end)
            (exact if span.exact_attention else batched).extend(range(first, len(tokens)))
            wanted.extend(range(len(tokens) - span.logits_rows, len(tokens)))
        dev = self.device
        wanted_rows = torch.tensor(wanted, dtype=torch.long, device=dev)
        if self.graphs is not None and self.graphs.takes(len(tokens)) and not (exact and batched):
            logits = self.graphs.forward(tokens, positions, tables, table_of, bool(exact), dtype, kernel_choice)
            logits = logits[wanted_rows]  # a copy: the bucket's buffers are the next replay's
        else:
            logits = self.model.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                        tables, torch.tensor(table_of, device=dev), AttentionPlan(exact, batched),
                                        self.kv, dtype=dtype, kernel_choice=kernel_choice, logits_rows=wanted_rows)
        # sampling, logprobs and margins read logits on the CPU (csrc/logits.cpp's fixed orders): the same
        # bits from the same logits whatever device computed them; on a GPU only a greedy row's argmax and
        # margin come back unless the request needs more
        logits = DeviceRows.read(logits) if self.on_device else logits.cpu()
        out, at = [], 0
        for span in spans:
            out.append(logits[at:at + span.logits_rows] if span.logits_rows else None)
            at += span.logits_rows
        return out

    def _tables(self, spans: list[Span]) -> tuple[torch.Tensor, list[int]]:
        """The block tables of the spans' requests ([T, W], -1 past a table's end; each span's positions made
        writable first) and, per row, which of them it reads."""
        width = blocks_for(max(span.end for span in spans), self.kv.block_size)
        owners = [BlockTable(self.kv, [self.sink] * width) if span.seq is None else span.seq.cache for span in spans]
        for span, table in zip(spans, owners):
            if span.seq is None:
                continue
            try:
                table.prepare(span.start, span.end)
            except PoolExhausted as e:  # the scheduler reserved this step's blocks: a bug, not memory pressure
                raise RuntimeError(f"a forward's span [{span.start}, {span.end}) found no block: {e}") from e
        index: dict[int, int] = {}
        for table in owners:
            index.setdefault(id(table), len(index))
        rows = list({id(t): t.blocks for t in owners}.values())
        width = max(len(r) for r in rows)
        tables = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)
        return tables, [index[id(t)] for span, t in zip(spans, owners) for _ in range(span.rows)]


def shared_choice(spans: list[Span]) -> KernelChoice:
    """The kernels of one forward over these spans: the invariant ones if any span needs them."""
    if any(s.kernel_choice is KernelChoice.INVARIANT for s in spans):
        return KernelChoice.INVARIANT
    return KernelChoice.LIBRARY
