"""Bounded load test of `margingate serve` on loopback: throughput and latency with 0 %, 10 % and
100 % deterministic traffic.

    PYTHONPATH=. .venv/bin/python scripts/load_test.py            # -> results/load_test.{json,md}

Starts the server as a subprocess on 127.0.0.1 (or uses --url, which must be a loopback address),
then for each deterministic fraction sends a fixed number of requests (default 48) from a fixed
number of concurrent clients (default 8), each asking for exactly --max-tokens tokens (ignore_eos),
under a wall-clock cap per scenario. Request i of every scenario uses the same prompt, and is
deterministic when i falls in the fraction (evenly spread), so the script also checks that a
deterministic request gets the same tokens in every scenario it appears in, whatever the mix.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from margingate.data.prompts import builtin_prompts  # noqa: E402


def is_deterministic(i: int, fraction: float) -> bool:
    """Evenly spread: request i is deterministic when floor((i+1)f) > floor(if)."""
    return math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def scrape(text: str) -> dict[str, float]:
    """Sum of every series of each metric (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or "_bucket" in m.group(1):
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "margingate", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--max-queue", str(max(64, args.requests)),
           "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MARGINGATE_API_KEY", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not come up within 300 s")


def request_body(prompt, args, deterministic: bool) -> tuple[str, dict]:
    body = {"model": args.model, "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
    if deterministic:
        body["deterministic"] = True
    if prompt.kind == "chat":
        return "/v1/chat/completions", {**body, "messages": list(prompt.messages)}
    return "/v1/completions", {**body, "prompt": prompt.text}


async def scenario(url: str, prompts, fraction: float, args) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    latencies, outputs, errors, statuses = [], {}, 0, {}
    deadline = time.monotonic() + args.time_cap
    async with httpx.AsyncClient(base_url=url, timeout=args.time_cap,
                                 limits=httpx.Limits(max_connections=args.concurrency)) as client:
        before = scrape((await client.get("/metrics")).text)

        async def one(i: int):
            nonlocal errors
            async with sem:
                if time.monotonic() > deadline:
                    statuses["skipped (time cap)"] = statuses.get("skipped (time cap)", 0) + 1
                    return
                det = is_deterministic(i, fraction)
                path, body = request_body(prompts[i % len(prompts)], args, det)
                t0 = time.perf_counter()
                try:
                    r = await client.post(path, json=body, timeout=max(1.0, deadline - time.monotonic()))
                except httpx.HTTPError as exc:
                    errors += 1
                    statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1
                    return
                statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
                if r.status_code != 200:
                    errors += 1
                    return
                latencies.append(time.perf_counter() - t0)
                data = r.json()
                outputs[i] = {"deterministic": det, "tokens": data["choices"][0]["token_ids"],
                              "report": data["determinism"]}

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
        after = scrape((await client.get("/metrics")).text)

    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    tokens = sum(len(o["tokens"]) for o in outputs.values())
    batch_n = delta.get("margingate_batch_size_count", 0.0)
    return {
        "deterministic_fraction": fraction,
        "requests": args.requests,
        "completed": len(outputs),
        "deterministic_requests": sum(o["deterministic"] for o in outputs.values()),
        "errors": errors,
        "statuses": statuses,
        "wall_s": round(wall, 3),
        "throughput_req_s": round(len(outputs) / wall, 3),
        "throughput_tok_s": round(tokens / wall, 2),
        "latency_p50_s": round(percentile(latencies, 0.50), 3) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 0.99), 3) if latencies else None,
        "latency_max_s": round(max(latencies), 3) if latencies else None,
        "mean_batch_size": round(delta.get("margingate_batch_size_sum", 0.0) / batch_n, 2) if batch_n else None,
        "engine_steps": int(delta.get("margingate_engine_steps_total", 0)),
        "triggers": int(delta.get("margingate_determinism_triggers_total", 0)),
        "repairs": int(delta.get("margingate_determinism_repairs_total", 0)),
        "rollbacks": int(delta.get("margingate_determinism_rollbacks_total", 0)),
        "replayed_tokens": int(delta.get("margingate_determinism_replayed_tokens_total", 0)),
        "_outputs": outputs,
    }


def markdown(report: dict) -> str:
    cfg, env = report["config"], report["environment"]
    lines = [
        "# Load test: `margingate serve` on loopback",
        "",
        f"{cfg['requests']} requests per row, {cfg['concurrency']} concurrent clients, {cfg['max_tokens']} output "
        f"tokens each (ignore_eos, greedy), max batch {cfg['max_batch_size']}, model `{env.get('model')}` on "
        f"{env.get('device')} with {env.get('num_threads')} torch thread(s), {report['host']['cpus']} CPUs "
        f"({report['host']['machine']}). Deterministic requests: `\"deterministic\": true` (policy margin, "
        f"tau {env.get('default_tau')} from the {env.get('tau_source')}, strict replay). "
        f"Latency: request sent to full response.",
        "",
        "| deterministic | completed | errors | wall s | req/s | tok/s | p50 latency s | p99 latency s "
        "| mean batch | triggers | repairs | rollbacks |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["scenarios"]:
        lines.append(f"| {r['deterministic_fraction']:.0%} | {r['completed']}/{r['requests']} | {r['errors']} "
                     f"| {r['wall_s']:.1f} | {r['throughput_req_s']:.2f} | {r['throughput_tok_s']:.1f} "
                     f"| {r['latency_p50_s']} | {r['latency_p99_s']} | {r['mean_batch_size']} | {r['triggers']} "
                     f"| {r['repairs']} | {r['rollbacks']} |")
    c = report["consistency"]
    lines += ["", f"Deterministic requests repeated across scenarios (same prompt, different traffic mix): "
                  f"{c['identical']}/{c['compared']} identical token sequences.",
              "", f"Measured {report['date']}; `scripts/load_test.py` with the settings above. A shared or "
                  "busy machine changes the absolute numbers; compare rows of one run."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an already running server (loopback only); default: start one")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=48, help="requests per scenario (fixed count)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--fractions", default="0,0.1,1", help="deterministic fractions, comma-separated")
    p.add_argument("--time-cap", type=float, default=600.0, help="seconds per scenario, at most")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="server torch threads (default: all cores)")
    p.add_argument("--device", default=None)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "results" / "load_test"), help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    fractions = [float(x) for x in args.fractions.split(",")]
    if not all(0 <= f <= 1 for f in fractions) or args.requests < 1 or args.concurrency < 1:
        p.error("fractions must be in [0, 1]; --requests and --concurrency >= 1")

    proc = None
    if args.url:
        host = urlparse(args.url).hostname or ""
        if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
            p.error("--url must be a loopback address: this script only loads a local server")
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args)
    try:
        prompts = builtin_prompts()
        info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        args.model = info["id"]
        for i in range(args.warmup):  # first-use costs out of the measurement
            path, body = request_body(prompts[i], args, i % 2 == 0)
            httpx.post(f"{url}{path}", json={**body, "max_tokens": 4}, timeout=args.time_cap)
        scenarios = []
        for f in fractions:
            print(f"deterministic {f:.0%}: {args.requests} requests, concurrency {args.concurrency} ...",
                  file=sys.stderr, flush=True)
            scenarios.append(asyncio.run(scenario(url, prompts, f, args)))
            r = scenarios[-1]
            print(f"  {r['completed']} done in {r['wall_s']:.1f} s, {r['throughput_tok_s']:.1f} tok/s, "
                  f"p50 {r['latency_p50_s']} s, p99 {r['latency_p99_s']} s, errors {r['errors']}",
                  file=sys.stderr, flush=True)
        environment = next((o["report"]["environment"] for s in scenarios for o in s["_outputs"].values()), {})
        # the same deterministic request (index i) in different traffic mixes must give the same tokens
        compared = identical = 0
        for i in range(args.requests):
            seqs = [s["_outputs"][i]["tokens"] for s in scenarios
                    if i in s["_outputs"] and s["_outputs"][i]["deterministic"]]
            if len(seqs) > 1:
                compared += 1
                identical += all(x == seqs[0] for x in seqs)
        for s in scenarios:
            s.pop("_outputs")
        report = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "config": {k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "time_cap",
                                                     "max_batch_size", "max_model_len", "threads", "warmup")},
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
            "environment": environment,
            "scenarios": scenarios,
            "consistency": {"compared": compared, "identical": identical},
        }
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    ok = report["consistency"]["identical"] == report["consistency"]["compared"]
    return 0 if ok and not any(s["errors"] for s in scenarios) else 1


if __name__ == "__main__":
    sys.exit(main())
