"""`margingate serve --replicas N`: the OpenAI app of server/app.py as a Ray Serve deployment.

Each replica is a Ray actor that builds one engine (as `serve` builds it locally, with its own
core budget) and the very same app around it: routes, API key guard, per-request determinism
report and /metrics are the single-process server's code. Ray Serve's HTTP proxy is the one
ingress; it hands every request to a replica as ASGI, and the app's lifespan starts and drains
the replica's engine thread. /metrics answers for the whole fleet (metrics.py).
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import uuid

from .. import cli_args
from . import metrics, require_ray
from .options import LOCAL, connect

APP_NAME = "margingate"


def deployment(args: argparse.Namespace, config, replicas: int, threads: int):
    """The bound Serve application: `replicas` engine replicas of `threads` CPUs each."""
    require_ray("--replicas", serve=True)
    from ray import serve

    from ..server.app import create_app

    # The app's own slots and queue decide admission (429 past --max-queue), as in one process;
    # Serve's router holds what every replica refuses to take.
    @serve.deployment(name=APP_NAME, num_replicas=replicas, ray_actor_options={"num_cpus": threads},
                      max_ongoing_requests=args.max_num_seqs + config.max_queue,
                      graceful_shutdown_timeout_s=config.shutdown_grace_s)
    @serve.ingress()
    class EngineReplica:
        def __init__(self, args, config):
            self.args, self.config = argparse.Namespace(**{**vars(args), "threads": threads}), config

        def __serve_build_asgi_app__(self):
            app = create_app(cli_args.llm(self.args, self.args.max_num_seqs), self.config)
            self.board, self.id, self.stop = metrics.board(), uuid.uuid4().hex, threading.Event()
            metrics.start_pushing(self.board, self.id, app.state.server.metrics.render, self.stop)
            return metrics.fleet_metrics(app, self.board, self.id)

        def __del__(self):
            if hasattr(self, "stop"):
                self.stop.set()
                self.board.drop.remote(self.id)

    return EngineReplica.bind(args, config)


def serve_replicas(args: argparse.Namespace, config) -> None:
    """Start (or join, with --ray ADDRESS) Ray, run the deployment behind Serve's HTTP proxy on
    --host:--port, block until interrupted, then shut the application down."""
    ray = require_ray("--replicas", serve=True)
    from ray import serve

    replicas = args.replicas or 1
    connect(args.ray or LOCAL, replicas * (args.threads or 1))
    threads = args.threads or max(1, int(ray.cluster_resources().get("CPU", 1)) // replicas)
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"serving {replicas} replicas x {threads} threads on http://{args.host}:{args.port} (Ray Serve)",
          file=sys.stderr)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM too: drain the replicas, stop what we started
    try:
        serve.run(deployment(args, config, replicas, threads), name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt(*_):
    raise KeyboardInterrupt
