from .engine import Engine, EngineConfig
from .sequence import Request, Result, Sequence

__all__ = ["Engine", "EngineConfig", "Request", "Result", "Sequence"]
