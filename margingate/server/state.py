"""What one app holds: the model, its engine and the engine thread, the settings, the metrics."""
from __future__ import annotations

import threading
import time

from ..data.prompts import Prompt
from ..engine.detokenize import decode_text, text_decoder
from ..engine.engine import Engine
from .config import ServerConfig
from .logprobs import LogprobFormatter
from .metrics import Metrics
from .reasoning import template_family
from .tools import template_format
from .worker import EngineWorker


class ServerState:
    def __init__(self, llm, engine: Engine, config: ServerConfig):
        self.llm, self.engine, self.config = llm, engine, config
        self.model_id = llm.model_name
        self.created = int(time.time())
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, self.metrics, max_queue=config.max_queue,
                                   heap_trim_idle_s=config.heap_trim_idle_s)
        engine.detokenize = text_decoder(llm.tokenizer.hf)  # the engine thread's own copy: it takes no lock
        engine.grammars = llm.grammars
        chat_template = getattr(llm.tokenizer.hf, "chat_template", None)
        self.tool_format = template_format(chat_template)  # tools.py
        self.reasoning_family = template_family(chat_template)  # reasoning.py
        llm.grammars.tokenizer  # built now, before any thread shares the HF tokenizer it reads (~1 s)
        self.environment = llm.environment()
        self.environment["num_threads"] = engine.num_threads
        self.fingerprint = (f"{self.environment['model_fingerprint']}-{self.environment['device']}"
                            f"-t{engine.num_threads}")
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self.formatter = LogprobFormatter(llm.tokenizer, self.tokenizer_lock)
        m, w = self.metrics, self.worker
        m.gauge("queue_length", "requests accepted and waiting for a KV slot", lambda: w.queue_length)
        m.gauge("running_requests", "requests holding a KV slot", lambda: w.running)
        m.gauge("in_flight_requests", "requests accepted and not finished", lambda: w.in_flight)
        m.gauge("kv_slots_free", "free KV slots", lambda: engine.load.free_slots)
        m.gauge("max_queue", "queued requests allowed beyond the running ones", lambda: config.max_queue)
        m.gauge("prefix_cache_tokens", "prompt positions held by the prefix cache (0: off)",
                lambda: engine.prefix.cached_tokens if engine.prefix is not None else 0)
        m.gauge("engine_alive", "1 while the engine thread runs", lambda: 1.0 if w.alive else 0.0)

    # --- tokenizer (serialized) -----------------------------------------------------
    def encode(self, prompt: Prompt, tools: list[dict] | None = None, **template) -> list[int]:
        with self.tokenizer_lock:
            return self.llm.tokenizer.encode_prompt(prompt, tools, **template)

    def encode_text(self, text: str) -> list[int]:
        """`text`'s ids, no special tokens added."""
        with self.tokenizer_lock:
            return self.llm.tokenizer.encode(text)

    def prompt_tail(self, ids: list[int], tokens: int = 32) -> str:
        """The text of the prompt's last tokens, special ones included (where a template opened a reasoning)."""
        with self.tokenizer_lock:
            return self.llm.tokenizer.hf.decode(ids[-tokens:], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """As the engine decodes a request's text (detokenize.py): /detokenize of a response's ids gives its text."""
        with self.tokenizer_lock:
            return decode_text(self.llm.tokenizer.hf, ids)
