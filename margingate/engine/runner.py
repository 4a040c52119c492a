"""Turns sequences and verify jobs into model forwards (rows, positions, slots, plan)."""
from __future__ import annotations

import torch

from ..kv_cache import KVCache
from ..models.llama import AttentionPlan, LlamaModel
from .policy import VerifyJob
from .sequence import Sequence


class Runner:
    def __init__(self, model: LlamaModel, kv: KVCache):
        self.model, self.kv, self.device = model, kv, model.device
        self.scratch_slot = kv.allocate()  # where the dummy rows of padded verifier passes write
        # bf16 GEMM rows are batch-invariant on CPU (tested); GPU GEMMs pick tiles by shape.
        self.matmul_rows_invariant = self.device.type == "cpu"

    def _forward(self, tokens: list[int], positions: list[int], slots: list[int], plan: AttentionPlan,
                 **kw) -> torch.Tensor:
        dev = self.device
        return self.model.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                  torch.tensor(slots, device=dev), plan, self.kv, **kw)

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """The whole prompt alone, causal: deterministic by construction. Returns last-row logits."""
        n = seq.prompt_len
        logits = self._forward(seq.request.prompt_ids, list(range(n)), [seq.slot] * n,
                               AttentionPlan(prefill=True), logits_rows=slice(n - 1, n))
        return logits[0]

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One step for every running sequence; [B, vocab] fp32 logits.

        One forward for the whole batch, unless some policy asks for another compute
        dtype (LayerCast) or for exact rows where GEMMs are not row-invariant.
        """
        exact_split = not self.matmul_rows_invariant
        key = lambda s: (s.policy.compute_dtype, exact_split and s.policy.exact_attention)  # noqa: E731
        groups: dict = {}
        for i, s in enumerate(seqs):
            groups.setdefault(key(s), []).append(i)
        out = torch.empty(len(seqs), self.model.config.vocab_size)
        for (dtype, rowwise), idx in groups.items():
            part = [seqs[i] for i in idx]
            plan = AttentionPlan(batched=[k for k, s in enumerate(part) if not s.policy.exact_attention],
                                 exact=[k for k, s in enumerate(part) if s.policy.exact_attention])
            out[idx] = self._forward([s.token_at(s.next_pos) for s in part], [s.next_pos for s in part],
                                     [s.slot for s in part], plan, dtype=dtype, rowwise=rowwise)
        return out

    def verify(self, jobs: list[VerifyJob]) -> list[torch.Tensor]:
        """Recompute every job's positions with the verifier's kernels.

        Each position is its own single-query row attending over exactly its prefix,
        so its K/V and logits do not depend on the other rows of the pass. Jobs share
        one pass per precision; fixed-shape jobs (`pad_to`) go in groups of `group`,
        each group padded to exactly group x pad_to rows.
        """
        results: list[torch.Tensor | None] = [None] * len(jobs)
        passes: dict = {}
        for i, j in enumerate(jobs):
            passes.setdefault((j.precision, j.pad_to, j.group), []).append(i)
        for (dtype, pad_to, group), idx in passes.items():
            chunks = [idx] if pad_to is None else [idx[k:k + group] for k in range(0, len(idx), group)]
            for chunk in chunks:
                self._verify_pass([jobs[i] for i in chunk], dtype, pad_to, group, results, chunk)
        return results

    def _verify_pass(self, jobs, dtype, pad_to, group, results, where) -> None:
        tokens, positions, slots = [], [], []
        for j in jobs:
            tokens += j.seq.tokens(j.start, j.end + 1)
            positions += range(j.start, j.end + 1)
            slots += [j.seq.slot] * j.rows
            if pad_to is not None:
                self._pad(tokens, positions, slots, pad_to - j.rows)
        if pad_to is not None:
            self._pad(tokens, positions, slots, (group - len(jobs)) * pad_to)
        rowwise = dtype != torch.bfloat16 or not self.matmul_rows_invariant
        logits = self._forward(tokens, positions, slots, AttentionPlan(exact=list(range(len(tokens)))),
                               dtype=dtype, rowwise=rowwise)
        offset = 0
        for i, j in zip(where, jobs):
            results[i] = logits[offset:offset + j.rows]
            offset += j.rows if pad_to is None else pad_to

    def _pad(self, tokens: list, positions: list, slots: list, n: int) -> None:
        """Dummy rows on the scratch slot: they only make the pass's shape fixed."""
        tokens += [0] * n
        positions += range(n)
        slots += [self.scratch_slot] * n
