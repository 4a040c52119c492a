"""`PolicySpec`: a policy by name and options, validated in one place.

The CLI, the HTTP protocol, the bench's variants and `LLM.policy` all build one, so there
is one set of defaults and one set of error messages. Options a policy does not use are
ignored (a `tau` given to `dvr` does nothing), but a bad value is refused whatever the policy.

`auto` is a name, not a policy: `resolve(device)` turns it into the cheapest guaranteed policy for
the device (`options.auto_policy`), and the built policy reports `chosen_by: auto`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine.policy import Policy, Promise
from ..errors import OptionError
from .batch_invariant import BatchInvariantPolicy
from .dvr import DVRPolicy
from .fast import FastLibraryPolicy, FastPolicy
from .layercast import LayerCastPolicy
from .margin import MarginPolicy, VerifyAllPolicy
from .options import (
    AUTO,
    DEFAULT_DEFER,
    DEFAULT_GROUP,
    DEFAULT_TAU,
    DEFAULT_WINDOW,
    MAX_DEFER,
    MAX_GROUP,
    MAX_WINDOW,
    auto_policy,
    int_in,
    parse_tau,
)
from .reference import PRECISIONS, ReferencePolicy
from .verifying import REPAIRS, VerifyingPolicy

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    FastPolicy, FastLibraryPolicy, ReferencePolicy, MarginPolicy, VerifyAllPolicy, DVRPolicy, BatchInvariantPolicy,
    LayerCastPolicy)}
POLICY_NAMES = [*POLICIES, AUTO]  # what a user may name


class PolicyOptionError(OptionError):
    """A bad policy option; `option` names the PolicySpec field."""


@dataclass(frozen=True)
class PolicySpec:
    name: str = "fast"
    tau: float | None = None          # margin: the logit margin below which a step is verified; None: the profile's
    repair: str = "replay"            # margin: replay | column | column-always | none
    verifier_precision: str = "bf16"  # the verifier's compute precision: bf16 | fp32
    strict: bool = True               # margin/replay: roll back emitted tokens that a late check disproves
    defer: int = DEFAULT_DEFER        # margin/replay: steps a flagged token may wait for a shared pass
    window: int = DEFAULT_WINDOW      # dvr
    group: int = DEFAULT_GROUP        # dvr
    inject_flip_at: int | None = None  # testing: emit a wrong token at this output index (verifying policies)
    chosen_by: str | None = None      # "auto" when `resolve` picked the name

    def __post_init__(self):
        for option, check in (("policy", self._check_name), ("tau", self._check_tau),
                              ("repair", self._check_repair), ("verifier_precision", self._check_precision),
                              ("strict", self._check_strict),
                              ("defer", lambda: int_in("defer", self.defer, 0, MAX_DEFER)),
                              ("window", lambda: int_in("dvr window", self.window, 1, MAX_WINDOW)),
                              ("group", lambda: int_in("dvr group", self.group, 1, MAX_GROUP)),
                              ("inject_flip_at", self._check_inject)):
            try:
                check()
            except ValueError as exc:
                raise PolicyOptionError(option, str(exc)) from None

    def _check_name(self):
        if self.name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.name!r} (choose from {', '.join(POLICY_NAMES)})")

    def _check_tau(self):
        if self.tau is not None:
            object.__setattr__(self, "tau", parse_tau(self.tau))

    def _check_repair(self):
        if self.repair not in REPAIRS:
            raise ValueError(f"unknown repair mode {self.repair!r} (choose from {', '.join(REPAIRS)})")

    def _check_precision(self):
        if self.verifier_precision not in PRECISIONS:
            raise ValueError(f"unknown verifier precision {self.verifier_precision!r} "
                             f"(choose from {', '.join(PRECISIONS)})")

    def _check_strict(self):
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be true or false, got {self.strict!r}")

    def _check_inject(self):
        if self.inject_flip_at is not None:
            int_in("inject_flip_at", self.inject_flip_at, 0)
            if self.name != AUTO and not issubclass(self.policy_class, VerifyingPolicy):
                raise ValueError(f"inject_flip_at needs a verifying policy, not {self.name}")

    def resolve(self, device: str) -> PolicySpec:
        """This spec with `auto` replaced by the policy it means on `device` (others unchanged)."""
        return self.replace(name=auto_policy(device), chosen_by=AUTO) if self.name == AUTO else self

    @property
    def policy_class(self) -> type[Policy]:
        if self.name == AUTO:
            raise ValueError("policy 'auto' has no class until resolved for a device (PolicySpec.resolve)")
        return POLICIES[self.name]

    def replace(self, **changes) -> PolicySpec:
        return dataclasses.replace(self, **changes)

    def build(self, default_tau: float = DEFAULT_TAU, device: str = "cpu") -> Policy:
        """A fresh policy object (policies hold no per-request state; one may serve many requests);
        a margin without a tau takes `default_tau` (the model profile's)."""
        spec = self.resolve(device)
        if spec.tau is None:
            spec = spec.replace(tau=default_tau)
        return spec.policy_class(spec)

    @property
    def promise(self) -> Promise:
        """What these options promise (`auto` resolves to a deterministic policy on every device)."""
        spec = self.resolve("cpu")
        return spec.policy_class.promise_for(spec)

    @property
    def deterministic(self) -> bool:
        return self.promise.deterministic


def deterministic_policies() -> list[str]:
    """Names whose defaults promise determinism (what a server's `"deterministic": true` may mean)."""
    return [*(name for name in POLICIES if PolicySpec(name).deterministic), AUTO]
