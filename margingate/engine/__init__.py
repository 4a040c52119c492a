"""The engine: requests and sequences (`sequence.py`), the policy interface (`policy.py`), the runner,
the verifier and the loop (`engine.py`: `Engine`). The package hands on only the
request types, so a module that needs a `Request` does not load the model code."""
from .sequence import Request, Result, Sequence

__all__ = ["Request", "Result", "Sequence"]
