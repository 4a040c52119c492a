"""Determinism policies, by name. Each is a small object behind `engine.policy.Policy`."""
from __future__ import annotations

from ..engine.policy import Policy
from .batch_invariant import BatchInvariantPolicy
from .dvr import DEFAULT_GROUP, DEFAULT_WINDOW, DVRPolicy
from .fast import FastPolicy
from .layercast import LayerCastPolicy
from .margin import DEFAULT_DEFER, DEFAULT_TAU, MarginPolicy, VerifyAllPolicy, parse_tau
from .reference import ReferencePolicy
from .verifying import REPAIRS

POLICIES = {"fast": FastPolicy, "reference": ReferencePolicy, "margin": MarginPolicy,
            "verify-all": VerifyAllPolicy, "dvr": DVRPolicy, "batch-invariant": BatchInvariantPolicy,
            "layercast": LayerCastPolicy}


def make_policy(name: str, *, tau: float | None = None, repair: str = "replay",
                precision: str = "bf16", strict: bool = True, window: int = DEFAULT_WINDOW,
                group: int = DEFAULT_GROUP, defer: int = DEFAULT_DEFER, default_tau: float = DEFAULT_TAU) -> Policy:
    """Build a policy from user-facing options; options a policy does not use are ignored."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    if tau is not None:
        parse_tau(tau)  # a bad tau is refused whatever the policy
    if name == "margin":
        return MarginPolicy(default_tau if tau is None else tau, repair, precision, strict, defer)
    if name == "dvr":
        return DVRPolicy(window, group, precision)
    if name in ("reference", "verify-all"):
        return POLICIES[name](precision=precision)
    return POLICIES[name]()


__all__ = ["DEFAULT_DEFER", "DEFAULT_GROUP", "DEFAULT_TAU", "DEFAULT_WINDOW", "POLICIES", "REPAIRS",
           "BatchInvariantPolicy", "DVRPolicy", "FastPolicy", "LayerCastPolicy", "MarginPolicy", "Policy",
           "ReferencePolicy", "VerifyAllPolicy", "make_policy"]
