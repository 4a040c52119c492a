"""`PolicySpec`: a policy by name and options, validated in one place, and what it promises.

The CLI, the HTTP protocol, the bench's variants and `LLM.policy` all build one, so there
is one set of defaults and one set of error messages. Options a policy does not use are
ignored (a `tau` given to `dvr` does nothing), but a bad value is refused whatever the policy.
What a spec promises is read from `PROMISES` here, with no policy built: the CLI, the server and
the reports ask before any model is loaded. The policies themselves are `policies/` (`build`).

`auto` is a name, not a policy: `resolve(device)` turns it into the cheapest guaranteed policy for
the device (`auto_policy`), and the built policy reports `chosen_by: auto`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import OptionError

DEFAULT_TAU = 0.5    # margin, when the model has no calibrated profile; see README
DEFAULT_DEFER = 8    # margin: steps a flagged token may wait for a shared pass; see README (bench)
DEFAULT_WINDOW = 16  # dvr: tokens per verified window
DEFAULT_GROUP = 4    # dvr: requests per fixed-shape verifier pass
# upper bounds: a value past them is a typo, not a setting (a 10^6-step deferral holds every token)
MAX_DEFER, MAX_WINDOW, MAX_GROUP = 1024, 256, 64

AUTO = "auto"        # not a policy: a name resolved per device to the cheapest guaranteed one
REPAIRS = ("replay", "column", "column-always", "none")
PRECISIONS = ("bf16", "fp32")  # the verifier's compute precisions (policies/reference.py maps them to dtypes)


@dataclass(frozen=True, slots=True)
class Promise:
    """What a policy with given options promises: read by the CLI, the server and the reports alike."""
    #: the request's tokens do not depend on what shares its batch
    deterministic: bool = False
    #: it gates and verifies: triggers, repairs and rollbacks are worth reporting
    verifies: bool = False
    #: its replay checks every token emitted on the fast path and rolls back to one that was wrong, so a token
    #: forced wrong (`inject_flip_at`) is taken back; verify-all's column repair checks each step as it comes
    #: and has no replay that would look back at a forced one
    rolls_back: bool = False

    @property
    def guarantees_logprobs(self) -> bool:
        """Are the reported logprobs batch-invariant too? Wherever the tokens are: the engine records
        a token's logprobs from the row that chose it, replaced by the verifier's row whenever one
        recomputes its position, and a deterministic policy releases a token only once the row it
        came from is canonical (an exact-attention decode row, or the verifier's)."""
        return self.deterministic


#: every policy by name, and what it promises with its default options. The one exception is margin's
#: repair: only the strict replay checks every emitted token against the verifier (`PolicySpec.promise`).
PROMISES = {
    "fast": Promise(),
    "fast-library": Promise(),
    "reference": Promise(deterministic=True),
    "margin": Promise(deterministic=True, verifies=True, rolls_back=True),
    "verify-all": Promise(deterministic=True, verifies=True),  # every column is the verifier's
    "dvr": Promise(deterministic=True, verifies=True, rolls_back=True),  # always the strict replay
    "batch-invariant": Promise(deterministic=True),
    "layercast": Promise(),
}
POLICY_NAMES = [*PROMISES, AUTO]  # what a user may name


class PolicyOptionError(OptionError):
    """A bad policy option; `option` names the PolicySpec field."""


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


def one_of(label: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {label} {value!r} (choose from {', '.join(choices)})")


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
        for option, check in (("policy", lambda: one_of("policy", self.name, POLICY_NAMES)),
                              ("tau", self._check_tau),
                              ("repair", lambda: one_of("repair mode", self.repair, REPAIRS)),
                              ("verifier_precision",
                               lambda: one_of("verifier precision", self.verifier_precision, PRECISIONS)),
                              ("strict", self._check_strict),
                              ("defer", lambda: int_in("defer", self.defer, 0, MAX_DEFER)),
                              ("window", lambda: int_in("dvr window", self.window, 1, MAX_WINDOW)),
                              ("group", lambda: int_in("dvr group", self.group, 1, MAX_GROUP)),
                              ("inject_flip_at", self._check_inject)):
            try:
                check()
            except ValueError as exc:
                raise PolicyOptionError(option, str(exc)) from None

    def _check_tau(self):
        if self.tau is not None:
            object.__setattr__(self, "tau", parse_tau(self.tau))

    def _check_strict(self):
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be true or false, got {self.strict!r}")

    def _check_inject(self):
        """A forced wrong token is a test of the rollback: refused where nothing would take it back (it would
        stay in the output, and a test of determinism would pass or fail for the wrong reason)."""
        if self.inject_flip_at is not None:
            int_in("inject_flip_at", self.inject_flip_at, 0)
            if self.name == AUTO:
                return  # checked once resolved
            if not PROMISES[self.name].verifies:
                raise ValueError(f"inject_flip_at needs a verifying policy, not {self.name}")
            if not self.promise.rolls_back:
                raise ValueError(f"inject_flip_at needs a policy that rolls back a wrong token (margin with the "
                                 f"strict replay, dvr); {self._options_named()} never would, and the forced token "
                                 f"would stay in the output")

    def _options_named(self) -> str:
        if self.name == "margin":
            return f"margin with repair {self.repair}" + ("" if self.strict else " and strict off")
        return self.name

    def resolve(self, device: str) -> PolicySpec:
        """This spec with `auto` replaced by the policy it means on `device` (others unchanged)."""
        return self.replace(name=auto_policy(device), chosen_by=AUTO) if self.name == AUTO else self

    def replace(self, **changes) -> PolicySpec:
        return dataclasses.replace(self, **changes)

    @property
    def promise(self) -> Promise:
        """What these options promise (`auto` resolves to a deterministic policy on every device)."""
        spec = self.resolve("cpu")
        if spec.name == "margin" and not (spec.repair == "replay" and spec.strict):
            return Promise(verifies=True)
        return PROMISES[spec.name]

    @property
    def deterministic(self) -> bool:
        return self.promise.deterministic


def deterministic_policies() -> list[str]:
    """Names whose defaults promise determinism (what a server's `"deterministic": true` may mean)."""
    return [*(name for name in PROMISES if PolicySpec(name).deterministic), AUTO]
