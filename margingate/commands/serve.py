"""`margingate serve`: the OpenAI-compatible server (margingate/server; registered in margingate/cli.py)."""
from __future__ import annotations

import importlib.util
import ipaddress
import os
import signal
import sys

from .. import cli_args
from ..distributed.options import add_ray_args
from ..embeddings import is_embedding_model
from ..options import deterministic_policies
from ..server.core.config import ServerConfig
from .embed import add_dtype_arg, embedder_for

LOOPBACK_NAMES = {"localhost"}


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with per-request determinism")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("MARGINGATE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $MARGINGATE_API_KEY)")
    cli_args.add_engine_args(p, ["max_num_seqs"])
    p.add_argument("--max-queue", type=cli_args.non_negative_int, default=ServerConfig.max_queue,
                   help="requests accepted beyond the KV slots; more get 429 with Retry-After")
    p.add_argument("--default-policy", default=ServerConfig.default_policy, choices=deterministic_policies(),
                   help='what "deterministic": true means (default auto: batch-invariant on CPU, margin on CUDA)')
    p.add_argument("--deterministic-by-default", action="store_true",
                   help="requests that ask for nothing get --default-policy too (for clients that cannot add "
                        'fields, such as lm-eval; "deterministic": false still opts out)')
    p.add_argument("--default-max-tokens", type=cli_args.positive_int, default=ServerConfig.default_max_tokens,
                   help="when a request gives none")
    p.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_grace_s,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish before they fail")
    p.add_argument("--heap-trim-idle", type=float, default=ServerConfig.heap_trim_idle_s, metavar="SECONDS",
                   help="once the engine has been idle this long, give the C heap's free pages back to the system "
                        "(glibc malloc_trim; 0: never)")
    p.add_argument("--cors-origins", nargs="+", default=(), metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), e.g. http://localhost:3000; * allows any")
    p.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                   help="the names clients may give as `model`: the first is what /v1/models lists and answers carry "
                        "(default: the model's own name; a file or folder without its directory)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--embedding-model", nargs="+", default=(), metavar="NAME",
                   help="embedding models /v1/embeddings serves beside the chat model, by name (all-minilm-l6-v2, "
                        "nomic-embed-text-v1.5, an encoder's folder or GGUF); the chat model's own name embeds with "
                        "its pooled hidden states. --model naming an embedding model serves embeddings alone")
    add_dtype_arg(p, "--embedding-dtype")
    cli_args.add_model_args(p)
    cli_args.add_prefix_cache_arg(p)
    cli_args.add_draft_model_arg(p)
    p.add_argument("--replicas", type=cli_args.positive_int, default=None, metavar="N",
                   help="N engine replicas behind one HTTP ingress on Ray Serve (--threads: each replica's; "
                        "default: the cores / N)")
    add_ray_args(p, workers=False)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> None:
    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None:
        raise ValueError("the server needs its extra: pip install 'margingate[server]'")
    from ..server.background import DrainingServer, uvicorn_config

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    config = ServerConfig(api_key=args.api_key or None, max_queue=args.max_queue, default_policy=args.default_policy,
                          default_max_tokens=args.default_max_tokens, shutdown_grace_s=args.shutdown_timeout,
                          deterministic_by_default=args.deterministic_by_default, cors_origins=tuple(args.cors_origins),
                          heap_trim_idle_s=args.heap_trim_idle, served_model_names=tuple(args.served_model_name))
    if args.replicas or args.ray:
        from ..distributed.serve import serve_replicas

        if args.embedding_model or is_embedding_model(args.model):
            raise ValueError("embedding models are not served with --replicas / --ray yet: serve them on one "
                             "process (`margingate serve --embedding-model ...`)")

        return serve_replicas(args, config)
    app = _app(args, config)
    # uvicorn re-raises the signal it shut down on; after a graceful drain, exit 0 instead.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = uvicorn_config(app, args.shutdown_timeout, host=args.host, port=args.port, log_level=args.log_level)
    DrainingServer(config, args.shutdown_timeout).run()


def _app(args, config: ServerConfig):
    """The chat app with the embedding models beside it (the chat model's own name embeds too), or, where
    --model names an embedding model, the app that serves embeddings alone (server/embedding_app.py)."""
    from ..embeddings import is_embedding_model
    from ..server.api.embeddings import EmbeddingModels
    from ..server.app import create_app
    from ..server.embedding_app import create_embedding_app
    from ..serving_context import served_name

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    extra = {served_name(m): embedder_for(m, args.embedding_dtype) for m in args.embedding_model}
    names = config.served_model_names or (served_name(args.model),)
    if is_embedding_model(args.model):
        main = embedder_for(args.model, args.embedding_dtype)
        return create_embedding_app(EmbeddingModels({**{n: main for n in names}, **extra}), config)
    llm = cli_args.llm(args, args.max_num_seqs)
    own = embedder_for(args.model, args.embedding_dtype, llm)
    return create_app(llm, config, embeddings=EmbeddingModels({**{n: own for n in names}, **extra}))
