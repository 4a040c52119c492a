"""What an RL trainer calls between rollouts (vLLM's names): new weights into the running server, pausing and
resuming generation, forgetting cached prefixes. Over HTTP (control_routes.py):

    POST /v1/update_weights {"path": folder of safetensors, "mode": "abort" | "wait" | "keep"}
    POST /pause?mode=abort|wait|keep      POST /resume      GET /is_paused      POST /reset_prefix_cache

and in the same process, from tensors (a trainer that runs the server beside itself, `BackgroundServer`):

    app.state.server.control.update_weights(model.state_dict(), mode="wait")   # the new weight version

The weights are read and checked whole (ServingContext.weights) before anything pauses, so a folder with a
missing or misshapen tensor is refused (400 naming it) and changes nothing. The swap itself runs on the engine
thread while paused (pause.py says what each mode does to the requests in flight); an update that found the
server running resumes it, one that found it paused leaves it paused (the trainer's own pause, resume).
One control call at a time: each blocks until it has taken effect, so it is called from any thread but the
engine's and the event loop's (the routes run it in the thread pool).
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from ...serving_context import ServingContext
from .pause import PAUSE_MODES
from .worker import EngineWorker


class Control:
    def __init__(self, context: ServingContext, worker: EngineWorker):
        self.context, self.worker, self.engine = context, worker, context.engine
        self._one_at_a_time = threading.Lock()

    def status(self) -> dict:
        w = self.worker
        return {"paused": w.paused is not None, "mode": w.paused, "held": w.held,
                "weight_version": self.engine.weight_version}

    def pause(self, mode: str = "abort") -> dict:
        with self._one_at_a_time:
            self._wait(self.worker.pause(mode))
        return self.status()

    def resume(self) -> dict:
        with self._one_at_a_time:
            resumed = self._wait(self.worker.resume())
        return {**self.status(), "resumed": resumed}

    def reset_prefix_cache(self) -> int:
        """The cached blocks dropped."""
        with self._one_at_a_time:
            return self._wait(self.worker.call(self.engine.reset_prefix_cache))

    def update_weights(self, source: Mapping | str, mode: str = "wait") -> int:
        """`source`: a state dict by transformers' names (a trainer's `state_dict()`, any dtype) or a folder of
        safetensors. Pauses in `mode` unless already paused (then that pause's mode holds), swaps, resumes if it
        paused. The new weight version; WeightsError (nothing changed) or RuntimeError."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._check_thread()
        weights = self.context.weights(source)
        with self._one_at_a_time:
            paused_before = self.worker.paused
            self._wait(self.worker.pause(paused_before or mode))
            try:
                return self._wait(self.worker.swap_weights(weights))
            finally:
                if paused_before is None:
                    self._wait(self.worker.resume())

    def _check_thread(self) -> None:
        if self.worker.on_engine_thread():  # it would wait for itself
            raise RuntimeError("a control call cannot run on the engine thread")

    def _wait(self, future: Future):
        """The future's result; RuntimeError if the engine thread stops first (nobody would resolve it)."""
        self._check_thread()
        while True:
            try:
                return future.result(timeout=0.5)
            except FutureTimeout:
                if not self.worker.alive:
                    raise RuntimeError("the engine thread is not running") from None
