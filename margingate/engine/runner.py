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
        """One step for every running sequence in one forward; [B, vocab] fp32 logits."""
        exact = [i for i, s in enumerate(seqs) if s.policy.exact_attention]
        if exact and not self.matmul_rows_invariant:
            return self._decode_split(seqs, exact)
        plan = AttentionPlan(batched=[i for i, s in enumerate(seqs) if not s.policy.exact_attention],
                             exact=exact)
        return self._forward([s.token_at(s.next_pos) for s in seqs], [s.next_pos for s in seqs],
                             [s.slot for s in seqs], plan)

    def _decode_split(self, seqs: list[Sequence], exact: list[int]) -> torch.Tensor:
        # Without row-invariant GEMMs, exact rows must not share a matmul with the rest.
        out = [None] * len(seqs)
        fast = [i for i in range(len(seqs)) if i not in set(exact)]
        if fast:
            for i, row in zip(fast, self.decode([seqs[i] for i in fast])):
                out[i] = row
        for i in exact:
            s = seqs[i]
            out[i] = self._forward([s.token_at(s.next_pos)], [s.next_pos], [s.slot],
                                   AttentionPlan(exact=[0]), rowwise=True)[0]
        return torch.stack(out)

    def verify(self, jobs: list[VerifyJob]) -> list[torch.Tensor]:
        """Recompute every job's positions with the verifier's kernels, one pass per precision.

        Each position is its own single-query row attending over exactly its prefix,
        so its K/V and logits do not depend on the other rows of the pass.
        """
        results: list[torch.Tensor | None] = [None] * len(jobs)
        for dtype in {j.precision for j in jobs}:
            group = [i for i, j in enumerate(jobs) if j.precision == dtype]
            tokens, positions, slots = [], [], []
            for i in group:
                j = jobs[i]
                tokens += j.seq.tokens(j.start, j.end + 1)
                positions += range(j.start, j.end + 1)
                slots += [j.seq.slot] * (j.end + 1 - j.start)
            rowwise = dtype != torch.bfloat16 or not self.matmul_rows_invariant
            logits = self._forward(tokens, positions, slots, AttentionPlan(exact=list(range(len(tokens)))),
                                   dtype=dtype, rowwise=rowwise)
            offset = 0
            for i in group:
                n = jobs[i].end + 1 - jobs[i].start
                results[i] = logits[offset:offset + n]
                offset += n
        return results
