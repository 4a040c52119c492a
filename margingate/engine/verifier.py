"""The verifier: what a policy asks to recompute, and the pass that recomputes it.

A verifying policy (`margin`, `dvr`, `verify-all`, fp32 `reference`) answers a decode step
with a `VerifyJob`: recompute positions [start, end] of its request. The engine hands every
job of the step to `Verifier.run`, which packs them into passes and returns each job's rows.

Each position is its own query row over exactly its prefix, through the invariant kernels,
so its K/V column and logits do not depend on the other rows of the pass: a verified row is
bitwise the row that decoding the request alone computes. Jobs share one pass per precision;
fixed-shape jobs (`pad_to`, LLM-42) go in groups of `group`, each padded to exactly
group x pad_to rows with dummy rows on a scratch block table, so a pass's cost does not depend on how
many of its rows are real.
"""
from __future__ import annotations

import torch

from ..kernels.choice import KernelChoice
from .policy import VerifyJob
from .runner import Runner, Span
from .sampling import RowChoices, choose


class Verifier:
    def __init__(self, runner: Runner):
        self.runner = runner

    def run(self, jobs: list[VerifyJob]) -> dict[int, RowChoices]:
        """Every job's rows and what they choose, keyed by id(job)."""
        logits = self.recompute(jobs)
        return {id(j): choose(j.seq, rows, j.start) for j, rows in zip(jobs, logits)}

    def recompute(self, jobs: list[VerifyJob]) -> list[torch.Tensor]:
        """Every job's raw logits rows, in order."""
        results: list[torch.Tensor | None] = [None] * len(jobs)
        passes: dict = {}
        for i, j in enumerate(jobs):
            passes.setdefault((j.precision, j.pad_to, j.group), []).append(i)
        for (dtype, pad_to, group), idx in passes.items():
            chunks = [idx] if pad_to is None else [idx[k:k + group] for k in range(0, len(idx), group)]
            for chunk in chunks:
                spans = self._pass([jobs[i] for i in chunk], pad_to, group)
                rows = self.runner.forward(spans, dtype, KernelChoice.INVARIANT)
                logits = [x for x, s in zip(rows, spans) if s.seq is not None]
                for i, x in zip(chunk, logits):
                    results[i] = x
        return results

    def _pass(self, jobs: list[VerifyJob], pad_to: int | None, group: int) -> list[Span]:
        """The spans of one pass: each job's positions, padded to the fixed shape if it has one."""
        spans = []
        for j in jobs:
            spans.append(Span(j.seq, j.start, j.end + 1, exact_attention=True, kernel_choice=KernelChoice.INVARIANT,
                              logits_rows=j.rows))
            if pad_to is not None:
                spans.append(self._padding(pad_to - j.rows))
        if pad_to is not None:
            spans.append(self._padding((group - len(jobs)) * pad_to))
        return spans

    def _padding(self, n: int) -> Span:
        """Dummy rows (on the runner's scratch table): they only make the pass's shape fixed."""
        return Span(None, 0, n, exact_attention=True, kernel_choice=KernelChoice.INVARIANT, logits_rows=0)
