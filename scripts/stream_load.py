"""Background load on `margingate serve`: N clients streaming /v1/chat/completions in a loop until killed.

    .venv/bin/python scripts/stream_load.py --base-url http://127.0.0.1:PORT/v1 [--clients 8]

Each client cycles through a few questions with different max_tokens, so the server's batch keeps changing
size and make-up while something else (scripts/lm_eval_check.sh: lm_eval) runs beside it. On SIGTERM or
SIGINT it stops after the streams in flight and prints one line: streams done, chunks received, errors.
Any error is printed as it happens; the exit status is 1 if there was one.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from openai import OpenAI

QUESTIONS = ["What is a prime number?", "Name three colours of the rainbow.", "Why is the sky blue?",
             "Write a short poem about rain.", "How do bees make honey?", "What does a compiler do?"]
MAX_TOKENS = [16, 48, 96, 32, 128, 64]


def client_loop(i: int, args, stop: threading.Event, counts: dict, lock: threading.Lock) -> None:
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    n = i
    while not stop.is_set():
        q, max_tokens = QUESTIONS[n % len(QUESTIONS)], MAX_TOKENS[(n * 5 + i) % len(MAX_TOKENS)]
        n += 1
        try:
            stream = client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": q}],
                                                    max_tokens=max_tokens, stream=True)
            chunks = sum(1 for _ in stream)
            with lock:
                counts["streams"] += 1
                counts["chunks"] += chunks
        except Exception as exc:  # noqa: BLE001 - reported and counted, the load goes on
            with lock:
                counts["errors"] += 1
            print(f"stream_load: client {i}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            stop.wait(1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the server's /v1 URL")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--model", default=None, help="model id (default: the server's)")
    p.add_argument("--api-key", default="none")
    args = p.parse_args()
    args.model = args.model or OpenAI(base_url=args.base_url, api_key=args.api_key).models.list().data[0].id

    stop, lock = threading.Event(), threading.Lock()
    counts = {"streams": 0, "chunks": 0, "errors": 0}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threads = [threading.Thread(target=client_loop, args=(i, args, stop, counts, lock), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=0.5)
    print(f"stream_load: {args.clients} clients, {counts['streams']} streams, {counts['chunks']} chunks, "
          f"{counts['errors']} errors", flush=True)
    return 1 if counts["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
