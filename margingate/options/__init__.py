"""What a caller asks for, as plain validated data with no torch: how a request samples
(`SamplingParams`), speculates (`SpeculativeConfig`), which determinism policy serves it
(`PolicySpec`, and the `Promise` it makes), and how the engine is sized (`EngineConfig`).
Everything else imports these; they import nothing of the engine."""
from ..errors import OptionError
from .engine import EngineConfig
from .policy import (
    AUTO,
    DEFAULT_DEFER,
    DEFAULT_GROUP,
    DEFAULT_TAU,
    DEFAULT_WINDOW,
    POLICY_NAMES,
    PRECISIONS,
    PROMISES,
    REPAIRS,
    PolicyOptionError,
    PolicySpec,
    Promise,
    deterministic_policies,
    parse_tau,
)
from .sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from .speculative import MAX_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig, SpeculativeError

__all__ = ["AUTO", "DEFAULT_DEFER", "DEFAULT_GROUP", "DEFAULT_TAU", "DEFAULT_WINDOW", "MAX_LOGPROBS", "EngineConfig",
           "MAX_SPECULATIVE_TOKENS", "METHODS", "POLICY_NAMES", "PRECISIONS", "PROMISES", "REPAIRS", "OptionError",
           "PolicyOptionError", "PolicySpec", "Promise", "SamplingError", "SamplingParams", "SpeculativeConfig",
           "SpeculativeError", "deterministic_policies", "parse_tau"]
