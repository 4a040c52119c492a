"""`margingate serve`: the OpenAI-compatible server (registered in margingate/cli.py)."""
from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import signal
import sys

from ..policies import POLICIES

LOOPBACK_NAMES = {"localhost"}


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum, with a message naming the bound."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def add_parser(sub, common) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with per-request determinism")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MARGINGATE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $MARGINGATE_API_KEY)")
    p.add_argument("--max-batch-size", type=_positive, default=16, help="KV slots = decode rows per step")
    p.add_argument("--max-queue", type=_non_negative, default=64,
                   help="requests accepted beyond the KV slots; more get 429 with Retry-After")
    p.add_argument("--default-policy", default="margin", choices=[p for p in POLICIES if p != "fast"],
                   help='what "deterministic": true means (default margin, the profile\'s tau)')
    p.add_argument("--default-max-tokens", type=_positive, default=256, help="when a request gives none")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds to let in-flight requests finish before failing them")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    common.add_model_args(p)
    p.set_defaults(func=lambda args: cmd_serve(args, common))


def cmd_serve(args, common=None) -> None:
    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None:
        raise ValueError("the server needs its extra: pip install 'margingate[server]'")
    from ..cli import Common
    from .app import create_app
    from .background import DrainingServer, uvicorn_config

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    llm = (common or Common).llm(args, args.max_batch_size)
    app = create_app(llm, api_key=args.api_key, max_queue=args.max_queue, default_policy=args.default_policy,
                     default_max_tokens=args.default_max_tokens, shutdown_grace_s=args.shutdown_timeout)
    # uvicorn re-raises the signal it shut down on; after a graceful drain, exit 0 instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = uvicorn_config(app, args.shutdown_timeout, host=args.host, port=args.port, log_level=args.log_level)
    DrainingServer(config, args.shutdown_timeout).run()
