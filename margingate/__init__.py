"""margingate: an LLM inference engine whose outputs do not depend on what shares the batch.

    from margingate import LLM, PolicySpec
    llm = LLM()
    llm.generate(["Why is the sky blue?"], policy=llm.policy("margin"))
"""
from __future__ import annotations

import importlib

# Loaded on first use, so `import margingate` (and the CLI's start) does not import torch.
_EXPORTS = {"LLM": ".llm", "PolicySpec": ".policies", "PolicyOptionError": ".policies"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'margingate' has no attribute {name!r}")
