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
from typing import TYPE_CHECKING, Any

import torch

from .sequence import Sequence
from .verifier import VerifyJob

if TYPE_CHECKING:
    from ..policies.spec import PolicySpec


@dataclass(frozen=True, slots=True)
class Promise:
    """What a policy with given options promises: derived once from the validated `PolicySpec`
    (`Policy.promise_for`), read by the CLI, the server and the reports alike."""
    #: the request's tokens do not depend on what shares its batch
    deterministic: bool = False
    #: it gates and verifies: triggers, repairs and rollbacks are worth reporting
    verifies: bool = False

    @property
    def guarantees_logprobs(self) -> bool:
        """Are the reported logprobs batch-invariant too? Wherever the tokens are: the engine records
        a token's logprobs from the row that chose it, replaced by the verifier's row whenever one
        recomputes its position, and a deterministic policy releases a token only once the row it
        came from is canonical (an exact-attention decode row, or the verifier's)."""
        return self.deterministic


class PolicyState:
    """A policy's memory of one request. The base remembers nothing."""

    def stats(self) -> dict[str, Any]:
        """Counters for the request's determinism report."""
        return {}


class Policy:
    """Built only from a validated `PolicySpec` (`PolicySpec.build`), whose options it trusts."""
    name = "base"
    #: decode rows attend over exactly their own prefix (else: as one padded batch, whose
    #: reduction order depends on the batch)
    exact_attention = False
    #: decode rows through PyTorch's library kernels (else: our compiled ones, faster here)
    library_kernels = False
    #: compute dtype of this request's decode forward (LayerCast: fp32 over bf16 weights)
    compute_dtype = torch.bfloat16

    def __init__(self, spec: PolicySpec):
        self.spec = spec
        self.promise = self.promise_for(spec)

    @classmethod
    def promise_for(cls, spec: PolicySpec) -> Promise:
        """What this policy promises with these options (the one place it is decided)."""
        return Promise()

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
    def chosen_by(self) -> str | None:
        """What picked this policy when the caller did not name it ("auto"), for the report."""
        return self.spec.chosen_by

    def new_state(self, seq: Sequence) -> PolicyState:
        return PolicyState()

    def propose(self, seq: Sequence, logits: torch.Tensor) -> VerifyJob | None:
        """Look at this step's fp32 logits. Return a job to verify, or None."""
        return None

    def join(self, seq: Sequence, logits: torch.Tensor) -> VerifyJob | None:
        """A verifier pass runs this step anyway (another request asked for it): return a job
        to ride along, or None. Joining costs rows but no extra pass."""
        return None

    def commit(self, seq: Sequence, logits: torch.Tensor, verified: torch.Tensor | None) -> None:
        """Append this step's token; `verified` holds the job's logits rows if a job ran."""
        seq.output_ids.append(int(torch.argmax(logits)))

    def finish_job(self, seq: Sequence) -> VerifyJob | None:
        """A stop condition was met: return a job to re-check before finishing, or None."""
        return None

    def confirm_finish(self, seq: Sequence, verified: torch.Tensor) -> bool:
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
