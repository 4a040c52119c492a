"""The server's settings, with the one copy of their defaults (the CLI and `create_app` read them)."""
from __future__ import annotations

from dataclasses import dataclass

from ...options import deterministic_policies


@dataclass(frozen=True)
class ServerConfig:
    api_key: str | None = None
    max_queue: int = 64                # requests accepted beyond the running ones; past that, 429
    default_policy: str = "auto"       # what `"deterministic": true` means: the cheapest guaranteed one here
    # every request that names no policy gets `default_policy`, as if it said "deterministic": true
    # (clients that cannot add fields: lm-eval's loglikelihood requests)
    deterministic_by_default: bool = False
    default_max_tokens: int = 256      # when a request gives no max_tokens
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 30.0     # in-flight requests get this long on SIGTERM
    retry_after_s: int = 1
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none: no CORS headers
    # after this many idle seconds the engine thread hands the C heap's free pages back (heap.py); 0: never
    heap_trim_idle_s: float = 1.0
    # the names clients may give as `model` (`--served-model-name`): the first is the one /v1/models lists and
    # answers carry; none: the model's own name (a file's or folder's without its directory)
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "api_key", self.api_key or None)  # "" means no key
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins or ()))
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names or ()))
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise ValueError(f"served_model_names must be non-empty strings, got {self.served_model_names!r}")
        if self.default_policy not in deterministic_policies():
            raise ValueError(f'default_policy must promise determinism (it is what "deterministic": true '
                             f'means): one of {", ".join(deterministic_policies())}, got {self.default_policy!r}')
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.heap_trim_idle_s < 0:
            raise ValueError(f"heap_trim_idle_s must be >= 0, got {self.heap_trim_idle_s}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
