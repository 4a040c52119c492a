"""Traced runs for the paper's diagnostics (`flips`, `calibrate`): what each decode step computed.

Tracing policies (subclasses of the engine's own policies; the engine is untouched) record,
per decode step, the top-k batched logits, the batched logits at the reference's top-k
token ids and the K/V column this step wrote, compared with the reference's column at the
same position. The reference is the `reference` policy (the verifier's kernels: its rows
attend over exactly their own prefix, bitwise what decoding alone computes, so the
references run in batches).

Step bookkeeping: output token 0 comes from the prefill (identical everywhere); decode
step k (k >= 1) computes the logits that choose output token k and writes the K/V column
of output token k-1 (the position of the last token, `seq.last_fed_pos`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.sequence import Sequence
from ..options import PolicySpec
from ..policies import FastPolicy, ReferencePolicy
from .diagnostics import DELTA_K, TOPK
from .runs import CachedRuns, batches


@dataclass
class Trace:
    """Per decode step of one request (step s chooses output token s+1)."""
    tokens: list[int] = field(default_factory=list)
    topv: list = field(default_factory=list)      # [TOPK] fp32 batched logits
    topi: list = field(default_factory=list)      # [TOPK] token ids
    at_ref: list = field(default_factory=list)    # [DELTA_K] batched logits at the reference's top ids
    dev: list = field(default_factory=list)       # [layers, 2] max |K - K_ref|, max |V - V_ref| of the column
    cols: list = field(default_factory=list)      # reference only: [2, layers, kv_heads, head_dim] bf16
    fired: list = field(default_factory=list)     # oracle: (output index, batched argmax differed)

    def pack(self) -> dict:
        out = {"tokens": list(self.tokens), "fired": list(self.fired)}
        out["topv"] = np.array(self.topv, np.float32).reshape(-1, TOPK)
        out["topi"] = np.array(self.topi, np.int32).reshape(-1, TOPK)
        out["at_ref"] = (np.array(self.at_ref, np.float32) if self.at_ref
                         else np.zeros((0, DELTA_K), np.float32))
        out["dev"] = np.stack(self.dev).astype(np.float32) if self.dev else np.zeros((0, 0, 2), np.float32)
        if self.cols:
            out["cols"] = torch.stack(self.cols)
        return out

    def record(self, seq: Sequence, logits: torch.Tensor, ref: dict | None, keep_columns: bool) -> None:
        """This step's logits and the column it wrote (compared with the reference's, if given)."""
        s = len(seq.output_ids) - 1
        assert s == len(self.topv), "a tracing policy saw a step twice (rollback?)"
        v, i = torch.topk(logits.float(), TOPK)
        self.topv.append(v.numpy())
        self.topi.append(i.numpy().astype(np.int32))
        k, vv = seq.cache.read(seq.last_fed_pos)
        if keep_columns:
            self.cols.append(torch.stack([k, vv]))
        if ref is not None and s < len(ref["topi"]):
            idx = torch.from_numpy(ref["topi"][s, :DELTA_K].astype(np.int64))
            self.at_ref.append(logits.float()[idx].numpy())
        if ref is not None and "cols" in ref and s < len(ref["cols"]):
            self.dev.append(column_deviation((k, vv), ref["cols"][s]))


def column_deviation(col, ref_col) -> np.ndarray:
    """Per layer: max |K - K_ref| and max |V - V_ref| over heads and dims."""
    dk = (col[0].float() - ref_col[0].float()).abs().amax(dim=(1, 2))
    dv = (col[1].float() - ref_col[1].float()).abs().amax(dim=(1, 2))
    return torch.stack([dk, dv], dim=1).numpy()


class TraceReference(ReferencePolicy):
    """The reference policy, recording its logits and the columns it writes."""

    def __init__(self, trace: Trace):
        super().__init__(PolicySpec("reference"))
        self.trace = trace

    def commit(self, seq, step, verified):
        self.trace.record(seq, (step if verified is None else verified).scores[-1], None, keep_columns=True)
        super().commit(seq, step, verified)


class TraceFast(FastPolicy):
    """Plain batched decoding, recording logits and column deviations against the reference."""

    def __init__(self, trace: Trace, ref: dict | None):
        super().__init__(PolicySpec("fast"))
        self.trace, self.ref = trace, ref

    def commit(self, seq, step, verified):
        self.trace.record(seq, step.scores[-1], self.ref, keep_columns=False)
        super().commit(seq, step, verified)


class OracleRepair(FastPolicy):
    """Table 5: at known flip positions emit the reference token and write the reference's column."""

    def __init__(self, trace: Trace, ref: dict, fire_at: set[int]):
        super().__init__(PolicySpec("fast"))
        self.trace, self.ref, self.fire_at = trace, ref, set(fire_at)

    def commit(self, seq, step, verified):
        k = len(seq.output_ids)
        s = k - 1
        if k in self.fire_at and s < len(self.ref["cols"]) and k < len(self.ref["tokens"]):
            col = self.ref["cols"][s]
            seq.cache.overwrite(seq.last_fed_pos, (col[0], col[1]))
            self.trace.fired.append((k, step.tokens[-1] != self.ref["tokens"][k]))
            self.trace.record(seq, step.scores[-1], self.ref, keep_columns=False)
            seq.output_ids.append(int(self.ref["tokens"][k]))
            return
        self.trace.record(seq, step.scores[-1], self.ref, keep_columns=False)
        seq.output_ids.append(step.tokens[-1])


def _traced(build) -> tuple:
    t = Trace()
    return build(t), t


class TraceRunner(CachedRuns):
    """The traced runs the diagnostics need, each cached like any run."""

    def reference(self) -> list[dict]:
        """One traced reference per prompt (tokens, top-k, columns), batched (bitwise alone)."""
        size = self.llm.engine.config.max_num_seqs
        run = self.run(self._reference_spec(), batches(len(self.ids), size, "chunks"),
                       lambda i, r: _traced(TraceReference), "reference")
        refs = [None] * len(self.ids)
        for i, _, _, packed in run["rows"]:
            refs[i] = packed
        return refs

    def _reference_spec(self) -> dict:
        return {"kind": "reference-trace", "rows": self.llm.engine.config.max_num_seqs}

    def fast(self, refs: list[dict], mode: str, size: int, homo_limit: int | None = None) -> dict:
        """`fast` in batches of `size` (hetero or homo), traced against the references."""
        spec = {"kind": "fast-trace", "mode": mode, "size": size, "homo_limit": homo_limit,
                "ref": self.key(self._reference_spec())}
        return self.run(spec, batches(len(self.ids), size, mode, homo_limit),
                        lambda i, r: _traced(lambda t: TraceFast(t, refs[i])), f"fast {mode} b={size}")

    def oracle(self, refs: list[dict], size: int, fire: dict[int, set[int]], round_: int) -> dict:
        """Heterogeneous batches of `size` holding a prompt to fire at, with the oracle repair."""
        groups = [g for g in batches(len(self.ids), size, "hetero") if any(fire.get(i) for i in g)]
        if not groups:
            return {"rows": [], "seconds": 0.0, "cached": True}
        spec = {"kind": "oracle", "size": size, "round": round_,
                "fire": {str(k): sorted(v) for k, v in sorted(fire.items())}}
        return self.run(spec, groups,
                        lambda i, r: _traced(lambda t: OracleRepair(t, refs[i], fire.get(i, set()))),
                        f"oracle b={size} round {round_}")
