"""What one app holds: what it serves (`serving_context.ServingContext`: the engine, tokenizer, templates,
grammars, policies), the engine thread, the settings, the metrics, and the trainer's controls (control.py:
`state.control.update_weights(state_dict)`, pause, resume)."""
from __future__ import annotations

import time

from ...serving_context import ServingContext
from ..parsers.reasoning import template_family
from ..protocol.logprobs import LogprobFormatter
from .config import ServerConfig
from .control import Control
from .metrics import Metrics
from .tools import template_format
from .worker import EngineWorker


class ServerState:
    def __init__(self, context: ServingContext, config: ServerConfig):
        self.context, self.config = context, config
        engine = self.engine = context.engine
        # what `model` may say: --served-model-name's names, else the model's own; the first is listed and echoed
        self.model_names = config.served_model_names or (context.model_id,)
        self.model_id = self.model_names[0]
        self.created = int(time.time())
        self.metrics = Metrics()
        self.worker = EngineWorker(engine, self.metrics, max_queue=config.max_queue,
                                   heap_trim_idle_s=config.heap_trim_idle_s)
        self.tool_format = template_format(context.chat_template, context.harmony)  # tools.py
        self.reasoning_family = template_family(context.chat_template, context.harmony)  # reasoning.py
        self.control = Control(context, self.worker)
        self.environment = context.environment  # at start: what changes later (the weight version) is read live
        self.formatter = LogprobFormatter(context.tokenizer, context.lock)
        self.metrics_gauges()

    @property
    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint: it changes with what changes the output, new weights included."""
        env, version = self.environment, self.engine.weight_version
        return (f"{env['model_fingerprint']}-{env['device']}-t{self.engine.num_threads}"
                + (f"-w{version}" if version else ""))

    def metrics_gauges(self) -> None:
        m, w, config, engine = self.metrics, self.worker, self.config, self.engine
        m.gauge("queue_length", "requests accepted and waiting for KV blocks", lambda: w.queue_length)
        m.gauge("running_requests", "requests holding KV blocks", lambda: w.running)
        m.gauge("in_flight_requests", "requests accepted and not finished", lambda: w.in_flight)
        m.gauge("kv_blocks_used", "KV pool blocks held by requests", lambda: engine.load.blocks_used)
        m.gauge("kv_blocks_free", "free KV pool blocks", lambda: engine.load.blocks_free)
        m.gauge("kv_blocks_cached", "KV pool blocks held by the prefix cache alone", lambda: engine.load.blocks_cached)
        m.gauge("kv_preemptions", "requests preempted for KV blocks (recomputed later)",
                lambda: engine.load.preemptions)
        m.gauge("max_queue", "queued requests allowed beyond the running ones", lambda: config.max_queue)
        m.gauge("prefix_cache_tokens", "prompt positions held by the prefix cache (0: off)",
                lambda: engine.prefix.cached_tokens if engine.prefix is not None else 0)
        m.gauge("engine_alive", "1 while the engine thread runs", lambda: 1.0 if w.alive else 0.0)
        m.gauge("paused", "1 while generation is paused (/pause, a weight update)", lambda: float(w.paused is not None))
        m.gauge("weight_version", "weight updates since load", lambda: engine.weight_version)
