"""The Ray options of `generate`, `check` and `serve`, and connecting to a Ray cluster."""
from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from .. import cli_args
from . import RAY_EXTRA, require_ray

LOCAL = "local"  # `--ray` without an address: a Ray instance started by this process
CONNECT_TIMEOUT_S = 5.0


def add_ray_args(p: argparse.ArgumentParser, workers: bool = True) -> None:
    g = p.add_argument_group(f"Ray (scale-out; needs {RAY_EXTRA})")
    g.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                   help="run on Ray: a cluster's address (HOST:PORT of `ray start --head`, ray://HOST:10001, "
                        "auto), or without one a Ray instance started here on this machine's cores")
    if workers:
        g.add_argument("--ray-workers", type=cli_args.positive_int, default=None, metavar="N",
                       help="Ray actors, one engine each (default: the cluster's CPUs / --threads-per-worker)")
        g.add_argument("--threads-per-worker", type=cli_args.positive_int, default=1, metavar="T",
                       help="torch threads (and Ray CPUs) of each worker's engine (default 1; the tokens "
                            "do not depend on it)")


def connect(address: str, cpus: int = 0) -> None:
    """Join the Ray cluster at `address` (or start one here, of at least `cpus` CPUs, for LOCAL);
    an address nobody answers at is a ValueError naming it."""
    ray = require_ray("--ray")
    if ray.is_initialized():  # a caller's (or a test's) session
        return
    if address == LOCAL:
        ray.init(num_cpus=max(cpus, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
        return
    if address != "auto":
        _reachable(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ValueError(f"cannot join the Ray cluster at {address!r}: {exc}") from None


def _reachable(address: str) -> None:
    """Fail in seconds, naming the address, where Ray itself would retry for a minute."""
    host_port = address.removeprefix("ray://")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray: expected HOST:PORT, ray://HOST:PORT or auto, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ValueError(f"--ray: no Ray cluster answers at {address} ({exc}); start one with "
                         f"`ray start --head` there, or check the address") from None


def check_args(args) -> None:
    """Ray-only options without --ray are a mistake, not something to ignore."""
    if args.ray is None and getattr(args, "ray_workers", None) is not None:
        raise ValueError("--ray-workers needs --ray")


@contextmanager
def worker_pool(args, max_num_seqs: int) -> Iterator:
    """With --ray, a pool of Ray workers (shut down after); without it, None: the local engine runs."""
    check_args(args)
    if args.ray is None:
        yield None
        return
    from .offline import WorkerPool

    threads = args.threads_per_worker
    connect(args.ray, (args.ray_workers or 1) * threads)
    cpus = int(require_ray("--ray").cluster_resources().get("CPU", 0))
    workers = args.ray_workers or max(1, cpus // threads)
    if workers * threads > cpus:
        raise ValueError(f"--ray-workers {workers} x --threads-per-worker {threads} needs {workers * threads} "
                         f"CPUs; the Ray cluster has {cpus}")
    pool = WorkerPool(args, workers=workers, threads=threads, max_num_seqs=max_num_seqs)
    try:
        yield pool
    finally:
        pool.shutdown()
