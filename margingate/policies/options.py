"""Policy option defaults and the checks of single values, shared by the spec and the policies."""
from __future__ import annotations

import math
from typing import Any

DEFAULT_TAU = 0.5    # margin, when the model has no calibrated profile; see README
DEFAULT_DEFER = 8    # margin: steps a flagged token may wait for a shared pass; see README (bench)
DEFAULT_WINDOW = 16  # dvr: tokens per verified window
DEFAULT_GROUP = 4    # dvr: requests per fixed-shape verifier pass
# upper bounds: a value past them is a typo, not a setting (a 10^6-step deferral holds every token)
MAX_DEFER, MAX_WINDOW, MAX_GROUP = 1024, 256, 64

AUTO = "auto"        # not a policy: a name resolved per device to the cheapest guaranteed one


def auto_policy(device: str) -> str:
    """The cheapest policy that guarantees determinism on `device`, from measurement (README, "auto").
    On CPU the invariant kernels decode faster than the library's (bench: 529 vs 349 tok/s at B=16),
    so every row may as well take them: `batch-invariant`, nothing to verify. On CUDA it depends on the
    GPU: what its `margingate bench` recorded (`auto_rule.py`), else `batch-invariant`."""
    if not str(device).startswith("cuda"):
        return "batch-invariant"
    from .auto_rule import measured

    return measured(device) or "batch-invariant"


def parse_tau(tau: Any) -> float:
    """A margin threshold in logits: a number >= 0; inf verifies every step."""
    if isinstance(tau, bool):
        raise ValueError(f"tau must be a number, got {tau!r}")
    try:
        value = float(tau)
    except (TypeError, ValueError):
        raise ValueError(f"tau must be a number, got {tau!r}") from None
    if math.isnan(value) or value < 0:
        raise ValueError(f"tau must be a number >= 0, got {tau!r}")
    return value


def int_in(label: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{label} must be an integer <= {maximum}, got {value!r}")
