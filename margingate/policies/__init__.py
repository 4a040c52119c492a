"""Determinism policies. Each is a small object behind `engine.policy.Policy`; a `PolicySpec`
(options/policy.py) names one with its options, and `build` makes it."""
from __future__ import annotations

from ..engine.policy import Policy, PolicyState
from ..options.policy import DEFAULT_TAU, PolicySpec
from .batch_invariant import BatchInvariantPolicy
from .dvr import DVRPolicy
from .fast import FastLibraryPolicy, FastPolicy
from .layercast import LayerCastPolicy
from .margin import MarginPolicy, VerifyAllPolicy
from .reference import ReferencePolicy
from .verifying import VerifyingPolicy, VerifyState

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (
    FastPolicy, FastLibraryPolicy, ReferencePolicy, MarginPolicy, VerifyAllPolicy, DVRPolicy, BatchInvariantPolicy,
    LayerCastPolicy)}


def build(spec: PolicySpec, default_tau: float = DEFAULT_TAU, device: str = "cpu") -> Policy:
    """A fresh policy object (policies hold no per-request state; one may serve many requests);
    `auto` resolves for `device`, and a margin without a tau takes `default_tau` (the model profile's)."""
    spec = spec.resolve(device)
    if spec.tau is None:
        spec = spec.replace(tau=default_tau)
    return POLICIES[spec.name](spec)


__all__ = ["POLICIES", "BatchInvariantPolicy", "DVRPolicy", "FastLibraryPolicy", "FastPolicy", "LayerCastPolicy",
           "MarginPolicy", "Policy", "PolicyState", "ReferencePolicy", "VerifyAllPolicy", "VerifyState",
           "VerifyingPolicy", "build"]
