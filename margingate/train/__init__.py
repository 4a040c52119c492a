"""The trainer's side of "rollout = trainer": a trainable forward whose logits are the engine's, bitwise
(`TrainableModel`), and the one definition of a token's logprob, raw or processed (`token_logprobs`)."""
from __future__ import annotations

from ..engine.logprobs import token_logprobs
from .model import CausalLMOutput, TrainableModel

__all__ = ["CausalLMOutput", "TrainableModel", "token_logprobs"]
