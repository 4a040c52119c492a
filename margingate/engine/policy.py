"""The interface every determinism policy implements.

A decode step reads: the runner computes logits for every running request
(each row with the kernels its policy asks for), then each policy `propose`s:
it may ask the verifier (`verifier.py`) to recompute some of its positions. If any does, the
others may `join` that pass. All those jobs run in one verifier pass, and each
policy `commit`s: it appends the token(s), may overwrite K/V columns through
`seq.cache` or roll back. When a request meets a stop condition its policy gets
`finish_job` / `confirm_finish` (a strict policy re-checks the unverified tail
there and may roll back, un-finishing it).

What a policy remembers about a request lives in the state it creates
(`new_state`, kept in `seq.state`); the engine never reads or writes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.choice import KernelChoice
from ..options.policy import PolicySpec, Promise
from .sampling import RowChoices
from .sequence import Sequence


@dataclass
class VerifyJob:
    """Recompute positions [start, end] of `seq` with the verifier's kernels, in `precision`.

    The pass feeds the tokens at those positions, writes their K/V (canonical columns) and returns
    one row per position (`RowChoices`: row i chooses the token at start + i + 1). `pad_to` fixes the
    job's shape: padded to that many rows and grouped with up to `group` jobs, the group padded with
    dummy jobs.
    """
    seq: Sequence
    start: int
    end: int
    precision: torch.dtype = torch.bfloat16
    pad_to: int | None = None
    group: int = 1

    @property
    def rows(self) -> int:
        return self.end + 1 - self.start


class PolicyState:
    """A policy's memory of one request. The base remembers nothing."""

    def stats(self) -> dict[str, Any]:
        """Counters for the request's determinism report."""
        return {}


class Policy:
    """Built only from a validated `PolicySpec` (`policies.build`), whose options it trusts."""
    name = "base"
    #: decode rows attend over exactly their own prefix (else: as one padded batch, whose
    #: reduction order depends on the batch)
    exact_attention = False
    #: its decode rows' kernels: LIBRARY, PyTorch's; INVARIANT, ours for every row that attends exactly,
    #: and for a batched row (whose bits depend on the batch anyway) the faster set of the device: ours
    #: on CPU, the library's on CUDA (`DecoderModel.invariant_is_fastest`)
    kernel_choice = KernelChoice.INVARIANT
    #: compute dtype of this request's decode forward (LayerCast: fp32 over bf16 weights)
    compute_dtype = torch.bfloat16
    #: its requests may speculate (`speculative.py`): drafts are accepted row by row through `commit`
    #: with no job, so only a policy that never verifies a step and whose rows are final says so
    speculates = False

    def __init__(self, spec: PolicySpec):
        self.spec = spec
        self.promise: Promise = spec.promise  # decided in one place, from the name and options

    @property
    def deterministic(self) -> bool:
        return self.promise.deterministic

    @property
    def verifies(self) -> bool:
        return self.promise.verifies

    @property
    def guarantees_logprobs(self) -> bool:
        return self.promise.guarantees_logprobs

    @property
    def decode_writes_prompt_bits(self) -> bool:
        """Do its decode rows write the K/V the prompt path would (exact attention, our kernels, bf16: a row's
        bits do not depend on the rows beside it)? Then a preempted request's decoded positions may be kept
        in the prefix cache like its prompt's (scheduler.py)."""
        return (self.exact_attention and self.kernel_choice is KernelChoice.INVARIANT
                and self.compute_dtype == torch.bfloat16)

    @property
    def chosen_by(self) -> str | None:
        """What picked this policy when the caller did not name it ("auto"), for the report."""
        return self.spec.chosen_by

    def new_state(self, seq: Sequence) -> PolicyState:
        return PolicyState()

    def propose(self, seq: Sequence, step: RowChoices) -> VerifyJob | None:
        """Look at this step's row (`step.scores`: its fp32 logits with the request's sampling applied;
        `step.tokens`: its choice). Return a job to verify, or None."""
        return None

    def join(self, seq: Sequence, step: RowChoices) -> VerifyJob | None:
        """A verifier pass runs this step anyway (another request asked for it): return a job
        to ride along, or None. Joining costs rows but no extra pass."""
        return None

    def commit(self, seq: Sequence, step: RowChoices, verified: RowChoices | None) -> None:
        """Append this step's token; `verified` holds the job's rows if a job ran."""
        seq.output_ids.append(step.tokens[-1])

    def finish_job(self, seq: Sequence) -> VerifyJob | None:
        """A stop condition was met: return a job to re-check before finishing, or None."""
        return None

    def confirm_finish(self, seq: Sequence, verified: RowChoices) -> bool:
        """After the finish job ran: True if the request really finishes."""
        return True

    def releasable(self, seq: Sequence) -> int:
        """How many output tokens may be handed to the caller now (streaming)."""
        return len(seq.output_ids)

    def settings(self) -> dict[str, Any]:
        return {}

    def report(self, seq: Sequence) -> dict[str, Any]:
        chosen = {"chosen_by": self.chosen_by} if self.chosen_by else {}
        return {"policy": self.name, **chosen, **self.settings(), "steps": seq.steps, **seq.state.stats()}
