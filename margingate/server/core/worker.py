"""The engine thread: the only code that touches the engine while the server runs.

HTTP handlers (on the asyncio loop) talk to it through a thread-safe inbox
(submit / abort) and get events back on a per-request asyncio.Queue, posted
with loop.call_soon_threadsafe. One loop, so requests from every connection
share each decode step (continuous batching).

Events posted to a request's queue, in order: events.py's `Event` (accepted, prompt, tokens, then done
or error).

Failure isolation: a request the engine refuses gets a 400 and nothing else
changes; if a step raises, the requests that were in the step fail with 500,
are removed from the engine (their KV blocks freed) and the loop goes on.

Pausing (vLLM's modes, for a trainer putting new weights in: control.py): while paused, new requests are
held, not given to the engine, until resumed. `abort` aborts the requests in flight (each answers with
finish_reason "abort"), `wait` lets them finish, `keep` stops stepping with them in place. A weight swap
runs here, between steps, while paused (`Engine.update_weights`).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import replace

from ...engine import Request
from ...engine.engine import Engine
from ...engine.events import StreamEvent
from ..protocol.errors import QueueFull, ShuttingDown
from .config import ServerConfig
from .events import Event, Handle
from .heap import IdleTrim
from .metrics import BATCH_BUCKETS, Metrics
from .pause import Pausing

log = logging.getLogger("margingate.server")


class EngineWorker(Pausing):
    def __init__(self, engine: Engine, metrics: Metrics | None = None, max_queue: int = ServerConfig.max_queue,
                 idle_poll_s: float = 0.05, heap_trim_idle_s: float | None = ServerConfig.heap_trim_idle_s):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self.capacity = engine.config.max_num_seqs + max_queue  # running + waiting
        self.idle_poll_s = idle_poll_s
        # once idle, the C heap's free pages go back (heap.py), and the pages of the KV pool's free blocks
        self.heap = IdleTrim(heap_trim_idle_s, also=engine.release_idle_memory)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0                 # submitted and not yet closed (guarded by _lock)
        self._handles: dict[str, Handle] = {}  # engine thread only
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="margingate-engine", daemon=True)
        self.waiting = 0                    # snapshots for gauges / health (written by the engine thread)
        self.running = 0
        self.last_error: str | None = None
        self._init_pause()                  # pause.py: the pause mode, the requests it holds

    # --- lifecycle (any thread) ----------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting and not self._stop.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queue_length(self) -> int:
        """Requests accepted but not yet holding KV blocks."""
        return max(0, self._in_flight - self.running)

    def drain(self, grace_s: float) -> None:
        """Begin a graceful shutdown (SIGTERM): refuse new requests (503) at once, let in-flight ones
        finish for up to grace_s, then fail what is left with a 503 (streams get an error event)."""
        if not self._accepting:
            return
        self._accepting = False
        self.call(self._resume)  # what a pause holds is in flight too: it gets the grace like the rest

        def fail_late():
            deadline = time.monotonic() + grace_s
            while self._in_flight and time.monotonic() < deadline and self.alive:
                time.sleep(0.05)
            if self._in_flight and self.alive:
                self._inbox.put(("fail_all", (503, f"the server is shutting down (in-flight requests get "
                                                  f"{grace_s:g} s to finish)")))

        threading.Thread(target=fail_late, name="margingate-drain", daemon=True).start()

    def shutdown(self, grace_s: float = ServerConfig.shutdown_grace_s) -> None:
        """Stop taking requests, let in-flight ones finish for up to grace_s, fail the rest (503)."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline and self.alive:
            time.sleep(0.05)
        self._inbox.put(("stop", None))
        self._stop.set()
        if self.alive:
            self._thread.join(timeout=max(5.0, grace_s))
        if not self.alive:  # requests still in the inbox (or a thread that never started)
            self._fail_all(503, "the server is shutting down", inbox=True)

    # --- the HTTP side (event loop thread) -----------------------------------------
    def submit(self, request: Request) -> Handle:
        """Queue a request for the engine; raises QueueFull or ShuttingDown. Call from the event loop."""
        if not self._accepting or self._stop.is_set() or not self.alive:
            raise ShuttingDown("the server is shutting down" if not self._accepting or self._stop.is_set()
                               else "the engine thread is not running")
        with self._lock:
            if self._in_flight >= self.capacity:
                raise QueueFull(f"{self._in_flight} requests in flight (capacity {self.capacity}: "
                                f"{self.engine.config.max_num_seqs} running + {self.max_queue} queued)")
            self._in_flight += 1
        handle = Handle(request, asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", handle))
        return handle

    def abort(self, handle: Handle, reason: str = "aborted") -> None:
        """The caller is done with this request (client gone, stop string): free its blocks now."""
        if not handle.closed:
            self._inbox.put(("abort", (handle, reason)))

    # --- the engine thread -----------------------------------------------------------
    def _post(self, handle: Handle, event: Event) -> None:
        if handle.closed:
            return
        if event.last:
            handle.closed = True
            with self._lock:
                self._in_flight -= 1
            self._handles.pop(handle.request_id, None)
        try:
            handle.loop.call_soon_threadsafe(handle.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server stopped): nobody is listening
            pass

    def _run(self) -> None:
        while True:
            try:
                if not self._drain_inbox(block=not self.engine.has_work or self.paused == "keep"):
                    break
                if self.engine.has_work and self.paused != "keep":
                    self._step()
                    self.heap.busy()
                elif self._in_flight == 0:
                    self._trim_when_idle()
                self._release_drained()
                load = self.engine.load
                self.waiting, self.running = load.waiting, load.running
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("engine loop error (continuing): %s", traceback.format_exc())
                time.sleep(0.01)
        self._fail_all(503, "the server is shutting down", inbox=True)

    def _trim_when_idle(self) -> None:
        released = self.heap.idle()
        if released is not None:
            self.metrics.inc("heap_trims_total")
            self.metrics.inc("heap_released_bytes_total", released)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every pending command; False when told to stop."""
        try:
            cmd = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return not self._stop.is_set()
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                try:
                    self._abort(*arg)
                except Exception as exc:  # noqa: BLE001 - never leave a caller waiting
                    log.error("abort failed: %s", traceback.format_exc())
                    self._post(arg[0], Event.error(500, f"abort failed: {exc}"))
            elif kind == "fail_all":
                self._fail_all(*arg)
            elif kind == "pause":
                self._pause(*arg)
            elif kind == "call":
                self._call(*arg)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, handle: Handle) -> None:
        if self.paused is not None:
            self._held.append(handle)
            return
        try:
            handle.seq = self.engine.add_request(handle.request)
        except ValueError as exc:
            self.metrics.inc("requests_rejected_total", reason="invalid")
            self._post(handle, Event.error(400, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            log.error("add_request failed: %s", traceback.format_exc())
            self._post(handle, Event.error(500, f"the engine could not take the request: {exc}"))
            return
        self._handles[handle.request_id] = handle
        self.metrics.inc("prompt_tokens_total", len(handle.request.prompt_ids))
        self._post(handle, Event("accepted"))

    def _abort(self, handle: Handle, reason: str) -> None:
        if handle.closed:
            return
        if handle in self._held:  # never given to the engine
            self._held.remove(handle)
            self._post(handle, Event.error(499, "aborted"))
            return
        self.engine.abort(handle.request_id)
        if reason == "disconnect":
            self.metrics.inc("client_disconnects_total")
        result = self.engine.result(handle.seq) if handle.seq is not None else None
        if result is not None:
            result.finish_reason = reason
            self._stamp(handle, result)
            self.metrics.finished(result, time.perf_counter() - handle.submitted)
            self._post(handle, Event("done", result=result))
        else:
            self._post(handle, Event.error(499, "aborted"))

    def _step(self) -> None:
        before = {phase: replace(t) for phase, t in self.engine.totals.items()}
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
            self._fail_step(exc)
            return
        self.metrics.inc("engine_steps_total")
        totals = self.engine.totals
        rows = totals["decode"].rows - before["decode"].rows
        if rows:
            self.metrics.observe("batch_size", rows, BATCH_BUCKETS)
        for phase, then in before.items():
            self.metrics.inc("engine_seconds_total", totals[phase].seconds - then.seconds, phase=phase)
        self._publish(set(finished))

    def _publish(self, finished: set) -> None:
        now = time.perf_counter()
        for handle in list(self._handles.values()):
            seq = handle.seq
            try:
                if not handle.admitted and seq.cache is not None:
                    handle.admitted = True
                    self.metrics.observe("queue_wait_seconds", now - handle.submitted)
                    if self.engine.prefix is not None:
                        hit = "hits" if seq.cached_tokens else "misses"
                        self.metrics.inc(f"prefix_cache_{hit}_total")
                        self.metrics.inc("prefix_cache_reused_tokens_total", seq.cached_tokens)
                event = self.engine.release(seq, seq in finished)
                if event is not None:
                    self._forward(handle, event, now)
            except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
                log.error("request %s failed: %s", handle.request_id, traceback.format_exc())
                self.engine.abort(handle.request_id)
                self._post(handle, Event.error(500, f"internal error in request {handle.request_id}: {exc}"))

    def _forward(self, handle: Handle, event: StreamEvent, now: float) -> None:
        """One release of the engine's, as the handle's events (and the metrics it moves)."""
        if event.prompt_logprobs is not None:
            self._post(handle, Event("prompt", prompt_logprobs=event.prompt_logprobs))
        if event.token_ids and handle.first_token is None:
            handle.first_token = now
            self.metrics.observe("time_to_first_token_seconds", now - handle.submitted)
        if event.token_ids or event.text:  # the last text may come with no token (a held-back tail)
            self.metrics.inc("generation_tokens_total", len(event.token_ids))
            self._post(handle, Event.tokens(event))
        if event.finished:
            self._stamp(handle, event.result)
            self.metrics.finished(event.result, time.perf_counter() - handle.submitted)
            self._post(handle, Event("done", result=event.result))

    def _fail_step(self, exc: Exception) -> None:
        """engine.step raised: fail every request that was in it, free their blocks, go on."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.error("engine step failed; failing its requests: %s", traceback.format_exc())
        self.metrics.inc("engine_step_errors_total")
        for request_id in self.engine.running_ids():
            self.engine.abort(request_id)
            handle = self._handles.get(request_id)
            if handle is not None:
                self._post(handle, Event.error(500, f"engine step failed: {type(exc).__name__}: {exc}"))

    def _fail_all(self, status: int, message: str, inbox: bool = False) -> None:
        held, self._held = self._held, []
        for handle in [*self._handles.values(), *held]:
            try:
                self.engine.abort(handle.request_id)
            except Exception:  # noqa: BLE001
                pass
            self._post(handle, Event.error(status, message))
        while inbox:  # requests submitted but never added
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._post(arg, Event.error(status, message))
