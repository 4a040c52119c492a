"""Pausing the engine thread, vLLM's way, for a trainer that puts new weights in (control.py drives it): the
worker's (worker.py) part that holds requests and swaps weights, apart so that the loop reads on its own.

While paused, requests submitted are held, not given to the engine, until resumed (they count against the queue
as queued ones do). The modes, for the requests in flight when the pause starts:
- `abort`: each is aborted and answers with finish_reason "abort" (a stream: its last chunk says so);
- `wait`: they run to their end; the pause holds once the engine has no work;
- `keep`: the loop stops stepping with them in place. A weight swap then preempts them (`Engine.update_weights`
  with `keep`): on resume each recomputes its K/V under the new weights and goes on from its tokens so far, so
  no forward mixes K/V of two versions (each counts as a preemption in the metrics). A request whose tokens two
  versions chose says so in its result
  (`weight_versions`, `weights_updated_at_token`), and jobs.determinism_report withdraws its guarantee.

Everything here that changes state runs on the engine thread (`call`, the inbox's "pause"): no other thread
touches the engine.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from .events import Handle

PAUSE_MODES = ("abort", "wait", "keep")


class Pausing:
    """Mixed into EngineWorker, whose `engine`, `_inbox`, `_thread`, `_handles`, `_add` and `_abort` it uses;
    its own state: `paused` (the mode in force, None: running), `_held` (submitted while paused), `_drained`
    (`wait` pauses, resolved once the engine has no work)."""

    def _init_pause(self) -> None:
        self.paused: str | None = None
        self._held: list = []
        self._drained: list[Future] = []

    # --- any thread -----------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        return len(self._held)

    def call(self, fn: Callable[[], object]) -> Future:
        """fn() run on the engine thread between steps: its result, or its exception, in the future."""
        future: Future = Future()
        self._inbox.put(("call", (fn, future)))
        return future

    def pause(self, mode: str) -> Future:
        """Pause in `mode`; the future resolves once the pause holds: at once for abort and keep, once the
        requests in flight have finished for wait. Pausing again changes the mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        future: Future = Future()
        self._inbox.put(("pause", (mode, future)))
        return future

    def resume(self) -> Future:
        """The future of the number of held requests given to the engine."""
        return self.call(self._resume)

    def swap_weights(self, weights) -> Future:
        """The future of the new weight version; refused (RuntimeError) unless paused, and under abort or wait
        unless nothing is in flight."""
        return self.call(lambda: self._swap(weights))

    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # --- the engine thread ------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], object], future: Future) -> None:
        try:
            future.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - the caller gets it, the loop goes on
            future.set_exception(exc)

    def _pause(self, mode: str, future: Future) -> None:
        self.paused = mode
        if mode == "abort":
            for handle in list(self._handles.values()):
                self._abort(handle, "aborted")
        if mode == "wait" and self.engine.has_work:
            self._drained.append(future)
        else:
            future.set_result(None)

    def _resume(self) -> int:
        self.paused = None
        held, self._held = self._held, []
        for handle in held:
            self._add(handle)
        return len(held)

    def _swap(self, weights) -> int:
        if self.paused is None:
            raise RuntimeError("the server was resumed before the weights were swapped: pause it first")
        before = self.engine.weight_version
        for handle in self._handles.values():  # kept in place with tokens chosen: two versions chose them
            if handle.seq is not None and handle.seq.output_ids and handle.weights_from is None:
                handle.weights_from = (before, len(handle.seq.output_ids))
        return self.engine.update_weights(weights, keep=self.paused == "keep")

    def _stamp(self, handle: Handle, result) -> None:
        """A result whose tokens two weight versions chose (kept in place across a swap) says which, and from
        which output token on the later one did (jobs.determinism_report reads it)."""
        if handle.weights_from is not None:
            version, at = handle.weights_from
            result.stats.update(weight_versions=[version, self.engine.weight_version], weights_updated_at_token=at)

    def _release_drained(self) -> None:
        """After each turn of the loop: a `wait` pause holds once the engine has no work left."""
        if self._drained and not self.engine.has_work:
            for future in self._drained:
                future.set_result(None)
            self._drained = []
