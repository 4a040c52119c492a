"""Determinism policies. Each is a small object behind `engine.policy.Policy`; a `PolicySpec`
names one with its options and builds it."""
from __future__ import annotations

from ..engine.policy import Policy, PolicyState
from .batch_invariant import BatchInvariantPolicy
from .dvr import DVRPolicy
from .fast import FastLibraryPolicy, FastPolicy
from .layercast import LayerCastPolicy
from .margin import MarginPolicy, VerifyAllPolicy
from .options import AUTO, DEFAULT_DEFER, DEFAULT_GROUP, DEFAULT_TAU, DEFAULT_WINDOW, parse_tau
from .reference import PRECISIONS, ReferencePolicy
from .spec import POLICIES, POLICY_NAMES, PolicyOptionError, PolicySpec, deterministic_policies
from .verifying import REPAIRS, VerifyingPolicy, VerifyState

__all__ = ["AUTO", "DEFAULT_DEFER", "DEFAULT_GROUP", "DEFAULT_TAU", "DEFAULT_WINDOW", "POLICIES", "POLICY_NAMES",
           "PRECISIONS", "REPAIRS", "BatchInvariantPolicy", "DVRPolicy", "FastLibraryPolicy", "FastPolicy",
           "LayerCastPolicy", "MarginPolicy", "Policy", "PolicyOptionError", "PolicySpec", "PolicyState",
           "ReferencePolicy", "VerifyAllPolicy", "VerifyState", "VerifyingPolicy", "deterministic_policies",
           "parse_tau"]
