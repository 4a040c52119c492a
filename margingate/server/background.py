"""Serving with uvicorn: a server that drains the engine on SIGTERM, and a background-thread runner
on a free loopback port (tests, load script)."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown (SIGTERM, SIGINT, should_exit) first tells the engine thread to
    drain: new requests get 503, in-flight ones get `grace_s` to finish, then fail with a 503 that
    reaches the client (an error event on a stream) before uvicorn's own timeout cancels anything."""

    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "server", None)
        if state is not None:
            state.worker.drain(self.grace_s)
        await super().shutdown(sockets=sockets)


def uvicorn_config(app, grace_s: float, **kw) -> uvicorn.Config:
    # uvicorn's own limit comes after the engine's grace, so failed requests are answered first
    return uvicorn.Config(app, timeout_graceful_shutdown=grace_s + 5.0, lifespan="on", **kw)


class BackgroundServer:
    """with BackgroundServer(app) as srv: ... srv.url ...; stop() is the SIGTERM path (graceful drain)."""

    def __init__(self, app, host: str = "127.0.0.1", grace_s: float = 10.0, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = DrainingServer(uvicorn_config(app, grace_s, log_level=log_level), grace_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="margingate-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """What SIGTERM does: stop accepting, drain in-flight requests, run the app's shutdown."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
