"""/metrics for a fleet of replicas: any replica answers with the sum over all of them.

Every replica pushes its own exposition (server/core/metrics.py's text) to one named actor, the
board, each PUSH_S; a GET /metrics that passed the app (API key included) is answered with the
board's texts summed series by series, the answering replica's own text fresh. Counters,
histogram buckets and gauges (queue length, running requests, free KV slots) all add up across
engines, so the names and meaning are the single-process server's; other replicas' figures are
at most PUSH_S old.
"""
from __future__ import annotations

import math
import threading

PUSH_S = 1.0
BOARD_NAME = "margingate-metrics"


class MetricsBoard:
    """The latest exposition text of each replica (the body of a Ray actor)."""

    def __init__(self):
        self.texts: dict[str, str] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = text

    def drop(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def all(self) -> dict[str, str]:
        return dict(self.texts)


def board():
    """The board actor, created by the first replica that asks (it outlives any one replica)."""
    import ray

    return (ray.remote(num_cpus=0)(MetricsBoard)
            .options(name=BOARD_NAME, get_if_exists=True, lifetime="detached").remote())


def summed(texts) -> str:
    """Prometheus text expositions added series by series (comments kept once, in order)."""
    out: dict[str, float | None] = {}
    for text in texts:
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                out.setdefault(line, None)
                continue
            series, value = line.rsplit(" ", 1)
            out[series] = (out.get(series) or 0.0) + float(value)
    return "\n".join(k if v is None else f"{k} {_num(v)}" for k, v in out.items()) + "\n"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() else repr(v)


def start_pushing(the_board, replica: str, render, stop: threading.Event) -> threading.Thread:
    def loop():
        while not stop.wait(PUSH_S):
            the_board.put.remote(replica, render())
    thread = threading.Thread(target=loop, name="metrics-push", daemon=True)
    thread.start()
    return thread


def fleet_metrics(app, the_board, replica: str):
    """`app` with GET /metrics answered for the whole fleet (after the app's own guard said yes)."""

    async def asgi(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/metrics":
            return await app(scope, receive, send)
        start, body = {}, []

        async def capture(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))

        await app(scope, receive, capture)
        data = b"".join(body)
        if start.get("status") == 200:
            texts = {**await the_board.all.remote(), replica: data.decode()}
            data = summed(texts.values()).encode()
            start["headers"] = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            start["headers"].append((b"content-length", str(len(data)).encode()))
        await send(start)
        await send({"type": "http.response.body", "body": data})

    return asgi
