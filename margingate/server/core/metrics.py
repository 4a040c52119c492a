"""Prometheus metrics, hand-written (text exposition format 0.0.4): no extra dependency.

Updated from two threads (the HTTP event loop and the engine thread): every
change goes through one lock.
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    def esc(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels) + "}"


def _num(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


class _Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1


class Metrics:
    """Counters, gauges (read live through callbacks) and histograms, rendered on demand."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self._hists: dict[str, dict[tuple, _Histogram]] = defaultdict(dict)
        self._help: dict[str, tuple[str, str]] = {}
        self._gauges: dict[str, Callable[[], float]] = {}
        self._declare()

    def _declare(self) -> None:
        c = "counter"
        for name, text in [
            ("http_requests_total", "HTTP requests answered, by route and status code"),
            ("requests_finished_total", "generation requests that ended, by policy and finish reason"),
            ("requests_rejected_total", "generation requests refused before reaching the engine, by reason"),
            ("prompt_tokens_total", "prompt tokens of the requests admitted to the engine"),
            ("generation_tokens_total", "output tokens released to clients"),
            ("determinism_triggers_total", "verifier runs started by a policy gate (margin below tau, full window)"),
            ("determinism_repairs_total", "tokens the verifier changed (the fast path's token was wrong)"),
            ("determinism_rollbacks_total", "rollbacks to a missed flip (strict replay, dvr)"),
            ("determinism_replayed_tokens_total", "positions recomputed by the verifier"),
            ("speculative_proposed_tokens_total", "tokens proposed by speculative decoding (checked exactly)"),
            ("speculative_accepted_tokens_total", "proposed tokens accepted (the acceptance rate: / proposed)"),
            ("speculative_steps_total", "decode steps that carried proposals (mean accepted length: accepted / steps)"),
            ("speculative_proposal_seconds_total", "time spent proposing"),
            ("speculative_held_steps_total", "steps a speculating request fed no proposals: the step cost model "
                                             "said they would not pay"),
            ("engine_steps_total", "engine steps (admit + prefill + one batched decode)"),
            ("engine_step_errors_total", "engine steps that raised; their requests failed with 500"),
            ("engine_seconds_total", "engine time by phase (prefill, decode, verify)"),
            ("client_disconnects_total", "requests aborted because the client went away"),
            ("prefix_cache_hits_total", "admitted requests that reused the K/V of a cached prompt prefix"),
            ("prefix_cache_misses_total", "admitted requests that found no cached prefix (prefix cache on)"),
            ("prefix_cache_reused_tokens_total", "prompt positions copied from the prefix cache, not computed"),
            ("heap_trims_total", "idle spells after which the engine thread gave the C heap's free pages back"),
            ("heap_released_bytes_total", "resident bytes those trims gave back to the system"),
        ]:
            self._help[name] = (c, text)
        for name, text in [
            ("request_latency_seconds", "end-to-end latency of generation requests (submit to last token)"),
            ("time_to_first_token_seconds", "submit to the first released token"),
            ("queue_wait_seconds", "submit to the engine's admission of the request (prefill)"),
            ("batch_size", "decode rows per engine step"),
        ]:
            self._help[name] = ("histogram", text)

    # --- updates -------------------------------------------------------------------
    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        with self._lock:
            self._counters[name][tuple(sorted(labels.items()))] += value

    def observe(self, name: str, value: float, buckets: Iterable[float] = LATENCY_BUCKETS, **labels) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            h = self._hists[name].get(key)
            if h is None:
                h = self._hists[name][key] = _Histogram(buckets)
            h.observe(value)

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time."""
        self._help[name] = ("gauge", help_text)
        self._gauges[name] = read

    # a finished request's stats -> the counters they move
    FINISHED_STATS = (("triggers", "determinism_triggers_total"), ("repairs", "determinism_repairs_total"),
                      ("rollbacks", "determinism_rollbacks_total"),
                      ("replayed_tokens", "determinism_replayed_tokens_total"),
                      ("proposed_tokens", "speculative_proposed_tokens_total"),
                      ("accepted_tokens", "speculative_accepted_tokens_total"),
                      ("speculative_steps", "speculative_steps_total"),
                      ("proposal_seconds", "speculative_proposal_seconds_total"),
                      ("speculation_held_steps", "speculative_held_steps_total"))

    def finished(self, result, latency_s: float) -> None:
        """A request that ran to its end (an engine `Result`): its finish, latency and policy's counts."""
        stats = result.stats
        policy = str(stats.get("policy", "?"))
        self.inc("requests_finished_total", policy=policy, finish_reason=result.finish_reason)
        self.observe("request_latency_seconds", latency_s)
        for key, name in self.FINISHED_STATS:
            self.inc(name, float(stats.get(key, 0) or 0), policy=policy)

    def value(self, name: str, **labels) -> float:
        """A counter's current value (tests, /health)."""
        with self._lock:
            if labels:
                return self._counters[name].get(tuple(sorted(labels.items())), 0.0)
            return sum(self._counters[name].values())

    # --- exposition ----------------------------------------------------------------
    def render(self, prefix: str = "margingate_") -> str:
        lines: list[str] = []
        with self._lock:
            counters = {k: dict(v) for k, v in self._counters.items()}
            hists = {k: {lk: (h.buckets, list(h.counts), h.sum, h.count) for lk, h in v.items()}
                     for k, v in self._hists.items()}
        for name, (kind, text) in self._help.items():
            full = prefix + name
            lines.append(f"# HELP {full} {text}")
            lines.append(f"# TYPE {full} {kind}")
            if kind == "counter":
                series = counters.get(name) or {(): 0.0}
                for labels, v in sorted(series.items()):
                    lines.append(f"{full}{_labels(labels)} {_num(v)}")
            elif kind == "gauge":
                try:
                    v = float(self._gauges[name]())
                except Exception:  # noqa: BLE001 - a scrape never fails on one gauge
                    v = float("nan")
                lines.append(f"{full} {_num(v) if not math.isnan(v) else 'NaN'}")
            else:
                for labels, (buckets, counts, total, count) in sorted(hists.get(name, {}).items()):
                    for b, n in zip(buckets, counts):
                        lines.append(f"{full}_bucket{_labels(labels + (('le', _num(float(b))),))} {n}")
                    lines.append(f"{full}_bucket{_labels(labels + (('le', '+Inf'),))} {count}")
                    lines.append(f"{full}_sum{_labels(labels)} {_num(float(total))}")
                    lines.append(f"{full}_count{_labels(labels)} {count}")
        return "\n".join(lines) + "\n"
