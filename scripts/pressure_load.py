"""Serving under memory pressure: 64 clients at once with long prompts against a small KV pool, beside the same
requests sent one by one.

    PYTHONPATH=. .venv/bin/python scripts/pressure_load.py --out results/pressure/after

Starts `margingate serve` on loopback (the embedded model, `--kv-cache-memory 0.25`, `--max-num-seqs 64`, the
prefix cache on as `serve` runs it) and sends `--clients` completions at once, each a distinct prompt of about
`--prompt-tokens` token ids and `--max-tokens` new tokens (greedy, ignore_eos, logprobs 1), the policies mixed
(margin, batch-invariant, dvr, fast in turn). Then, unless `--skip-alone`, the same requests one at a time:
their total is the one-by-one time, and each deterministic answer (tokens and logprobs) is compared with its
concurrent one. Reports wall time, preemptions (the server's /metrics), p50/p99 latency, the most requests
running at once, errors and mismatches: OUT.json and OUT.md. Exit status 1 on any error or mismatch.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test_report import percentile  # noqa: E402
from serve_process import REPO, cpu_name, scrape, start_server  # noqa: E402

POLICIES = ["margin", "batch-invariant", "dvr", "fast"]  # request i takes POLICIES[i % 4]
DETERMINISTIC = {"margin", "batch-invariant", "dvr"}
WORDS = ("the system stores each record in a ledger and every clerk checks the totals before the office closes "
         "while engineers measure latency under load and write notes about queues caches memory threads and "
         "what happens when a pool of blocks runs out during a busy afternoon in the data centre").split()


async def prompts(client: httpx.AsyncClient, n: int, target: int) -> list[list[int]]:
    """`n` distinct prompts of token ids, `target` +- 2 % long: seeded word salad, tokenized by the server."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        text = f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(int(target * 1.3)))
        r = await client.post("/tokenize", json={"prompt": text})
        r.raise_for_status()
        out.append(r.json()["tokens"][:target + rng.randint(-target // 50, target // 50)])
    return out


def body(ids: list[int], i: int, max_tokens: int) -> dict:
    return {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "logprobs": 1,
            "determinism": {"policy": POLICIES[i % len(POLICIES)]}}


async def send(client: httpx.AsyncClient, b: dict) -> dict:
    """One non-streamed completion: status, token ids, logprobs, latency, error."""
    t0 = time.perf_counter()
    out = {"status": None, "ids": None, "logprobs": None, "latency": None, "error": None}
    try:
        r = await client.post("/v1/completions", json=b)
        out["status"] = r.status_code
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            out["ids"], out["logprobs"] = choice["token_ids"], choice["logprobs"]
        else:
            out["error"] = r.text[:200]
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["latency"] = time.perf_counter() - t0
    return out


async def watch_running(client: httpx.AsyncClient, stop: asyncio.Event) -> int:
    """The most requests holding KV blocks at once, sampled from /metrics every 0.5 s until `stop`."""
    most = 0
    while not stop.is_set():
        try:
            m = scrape((await client.get("/metrics")).text)
            most = max(most, int(m.get("margingate_running_requests", 0)))
        except httpx.HTTPError:  # a sample lost is no result lost
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    return most


async def concurrent(client: httpx.AsyncClient, bodies: list[dict]) -> dict:
    before = scrape((await client.get("/metrics")).text)
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch_running(client, stop))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(send(client, b) for b in bodies))
    wall = time.perf_counter() - t0
    stop.set()
    after = scrape((await client.get("/metrics")).text)
    ok = [r["latency"] for r in results if r["status"] == 200]
    return {"results": results, "wall_s": round(wall, 1), "max_running": await watcher,
            "preemptions": int(after.get("margingate_kv_preemptions", 0) - before.get("margingate_kv_preemptions", 0)),
            "errors": sum(r["status"] != 200 for r in results),
            "latency_p50_s": percentile(ok, 0.5), "latency_p99_s": percentile(ok, 0.99)}


async def one_by_one(client: httpx.AsyncClient, bodies: list[dict], together: list[dict]) -> dict:
    """Each request alone, in turn; each deterministic one's tokens and logprobs against its concurrent answer."""
    t0, compared, mismatched, errors = time.perf_counter(), 0, [], 0
    for i, (b, got) in enumerate(zip(bodies, together)):
        alone = await send(client, b)
        errors += alone["status"] != 200
        if b["determinism"]["policy"] in DETERMINISTIC and got["status"] == 200 and alone["status"] == 200:
            compared += 1
            if (got["ids"], got["logprobs"]) != (alone["ids"], alone["logprobs"]):
                mismatched.append(f"request {i} ({b['determinism']['policy']})")
    return {"wall_s": round(time.perf_counter() - t0, 1), "errors": errors, "compared": compared,
            "equal": compared - len(mismatched), "mismatched": mismatched}


async def run(url: str, args) -> dict:
    # no keep-alive: a connection the server closed while idle (uvicorn: after 5 s) would fail the next request
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        ids = await prompts(client, args.clients, args.prompt_tokens)
        bodies = [body(x, i, args.max_tokens) for i, x in enumerate(ids)]
        await send(client, body(ids[0][:64], 1, 2))  # first-use costs out of the measurement
        report = {"prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1)}
        report["concurrent"] = await concurrent(client, bodies)
        print(f"concurrent: {json.dumps({k: v for k, v in report['concurrent'].items() if k != 'results'})}",
              file=sys.stderr, flush=True)
        if not args.skip_alone:
            report["one_by_one"] = await one_by_one(client, bodies, report["concurrent"]["results"])
        del report["concurrent"]["results"]
    return report


def markdown(report: dict) -> str:
    c, a, cfg = report["concurrent"], report.get("one_by_one"), report["config"]
    lines = ["# 64 clients under memory pressure", "", "```bash", report["command"], "```", "",
             f"Machine: {report['cpu']}, {report['cpus']} cores, the server at {cfg['threads']} threads; measured "
             f"{report['date']} (1-minute load average {report['load_avg_1m']:.1f} at the end: the machine was "
             f"shared). {cfg['clients']} clients at once, prompts of {report['prompt_tokens_mean']} tokens on "
             f"average, {cfg['max_tokens']} new tokens, policies {', '.join(POLICIES)} in turn, "
             f"`--kv-cache-memory {cfg['kv_cache_memory']}`.", "",
             "| run | wall s | preemptions | p50 latency s | p99 latency s | most running | errors |",
             "|---|---|---|---|---|---|---|",
             f"| concurrent | {c['wall_s']} | {c['preemptions']} | {c['latency_p50_s']} | {c['latency_p99_s']} | "
             f"{c['max_running']} | {c['errors']} |"]
    if a is not None:
        lines += [f"| one by one | {a['wall_s']} | | | | 1 | {a['errors']} |", "",
                  f"Concurrent / one by one: {a['wall_s'] / c['wall_s']:.2f}x faster. Deterministic answers equal "
                  f"to the request alone (tokens and logprobs): {a['equal']} / {a['compared']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=1400)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--kv-cache-memory", type=float, default=0.25, help="GB of KV pool")
    p.add_argument("--threads", type=int, default=2, help="server torch threads")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one request may take")
    p.add_argument("--skip-alone", action="store_true", help="the concurrent run only")
    p.add_argument("--out", default=str(REPO / "results" / "pressure" / "run"), help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    args.max_num_seqs, args.max_queue, args.max_model_len = 64, 64, 4096  # what start_server passes
    proc, url = start_server(args, extra=("--kv-cache-memory", str(args.kv_cache_memory)))
    try:
        report = asyncio.run(run(url, args))
    finally:
        proc.kill()
    report = {"command": "PYTHONPATH=. .venv/bin/python scripts/pressure_load.py "
                         + shlex.join(sys.argv[1:] if argv is None else argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_avg_1m": os.getloadavg()[0], "cpu": cpu_name(),
              "cpus": os.cpu_count(), "config": {k: getattr(args, k) for k in (
                  "clients", "prompt_tokens", "max_tokens", "kv_cache_memory", "threads", "max_num_seqs")}, **report}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    bad = report["concurrent"]["errors"] or (report.get("one_by_one") or {}).get("mismatched")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
