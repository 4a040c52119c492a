"""What a server serves, gathered below it: one model's engine (built whole: its draft, detokenizer and grammars
given to `Engine.__init__`), its tokenizer behind one lock, its chat template, grammars and policies, and the
environment its reports record. The server reads these here, never the facade (`llm.py`) they came from.

    context = ServingContext.of(llm)                 # or ServingContext.of(llm, engine=another_engine)
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from .engine.detokenize import decode_text
from .engine.engine import Engine
from .engine.policy import Policy
from .engine.structured import Grammars
from .models.loader import replacement_weights
from .models.tokenizer import Tokenizer
from .models.weights import ModelWeights, WeightsError

__all__ = ["ServingContext", "WeightsError"]


def served_name(model: str) -> str:
    """The name a model is served under by default: a file or folder on disk by its own name, without the
    directory (clients such as openai-agents read a `/` in a model name as a provider prefix and refuse it);
    a named or Hub model as given."""
    path = Path(model)
    return path.name if path.name and path.exists() else model


class ServingContext:
    def __init__(self, model_id: str, engine: Engine, tokenizer: Tokenizer, policy: Callable[..., Policy], *,
                 device: str, default_tau: float, vocab_size: int, environment: dict):
        if engine.detokenize is None or engine.grammars is None:
            raise ValueError("the engine must be built whole to be served: Engine(..., detokenize=..., grammars=...)")
        self.model_id, self.engine, self.tokenizer, self.policy = model_id, engine, tokenizer, policy
        self.device, self.default_tau, self.vocab_size = device, default_tau, vocab_size
        self.environment = {**environment, "num_threads": engine.num_threads}
        self.chat_template = tokenizer.chat_template
        self.harmony = tokenizer.harmony  # gpt-oss's format: the server's parsers read its channels
        self.lock = threading.Lock()  # one request's tokenizer work at a time (the template renders in Python)
        self.grammars.tokenizer  # built now (~1 s), not inside a request

    @classmethod
    def of(cls, llm, engine: Engine | None = None) -> ServingContext:
        """The facade's model served on its engine, or on `engine` (one built whole over the same model)."""
        engine = engine or llm.engine
        return cls(served_name(llm.model_name), engine, llm.tokenizer, llm.policy, device=llm.device,
                   default_tau=llm.default_tau, vocab_size=llm.config.vocab_size, environment=llm.environment())

    def weights(self, source: Mapping[str, torch.Tensor] | str | Path) -> ModelWeights:
        """New weights for the served model, built and checked whole (by transformers' tensor names and the
        config's shapes) without touching the engine: a state dict, or a folder of safetensors. WeightsError
        names the first missing, stray or misshapen tensor. The engine thread swaps them in
        (`Engine.update_weights`)."""
        return replacement_weights(self.engine.model, source)

    @property
    def grammars(self) -> Grammars:
        """The engine's: a constraint compiled at the door is the one the engine thread matches."""
        return self.engine.grammars

    @property
    def draft(self):
        """The engine's draft model (None: no `speculative: draft` here)."""
        return self.engine.draft

    @property
    def max_len(self) -> int:
        return self.engine.max_len

    # --- the tokenizer, one thread at a time -----------------------------------------------------------
    def encode_prompt(self, prompt, tools: list[dict] | None = None, **template) -> list[int]:
        with self.lock:
            return self.tokenizer.encode_prompt(prompt, tools, **template)

    def encode(self, text: str) -> list[int]:
        """`text`'s ids, no special tokens added."""
        with self.lock:
            return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        """As the engine decodes a request's text (detokenize.py): /detokenize of a response's ids gives its text."""
        with self.lock:
            return decode_text(self.tokenizer, ids)

    def prompt_tail(self, ids: list[int], tokens: int = 32) -> str:
        """The text of the prompt's last tokens, special ones included (where a template opened a reasoning)."""
        with self.lock:
            return self.tokenizer.decode(ids[-tokens:], skip_special_tokens=False)
