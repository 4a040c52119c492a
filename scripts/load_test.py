"""Bounded load and fault test of `margingate serve` on loopback, at the server's default threads (all cores).

    PYTHONPATH=. .venv/bin/python scripts/load_test.py            # -> results/load_test.{json,md}

Starts `margingate serve` as a subprocess on 127.0.0.1 (prefix cache on, `"deterministic": true` = auto) and
runs, in order:

1. traffic mixes (0 %, 10 %, 100 % deterministic): a fixed number of streamed requests from a fixed number
   of concurrent clients, each asking for exactly --max-tokens tokens (ignore_eos): throughput, p50/p99
   latency and time to first token (TTFT);
2. 8 concurrent streaming clients with mixed policies on the held-in (built-in) prompts;
3. 8 concurrent streaming clients, each a 3-turn conversation under one system prompt, mixed policies
   (later turns hit the prefix cache);
4. TTFT on a long shared system prompt: cold (never seen) against a hit (same system prompt, another
   question), and the cold request sent again (a hit) must give the same tokens;
5. clients that disconnect mid-stream: the time until every KV slot is free again;
6. a burst beyond the queue: the excess gets 429, every accepted request completes in full;
7. SIGTERM under load: the streams in flight finish ([DONE], all tokens), the server exits 0.

Every deterministic response whose policy guarantees it (the report's `guaranteed`) is compared, token for
token, with the same request sent alone afterwards (non-streamed, nothing else running). Any 5xx, lost
response or mismatch makes the script exit 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test_report import markdown, percentile, summarize  # noqa: E402
from serve_process import REPO, cpu_name, scrape, start_server  # noqa: E402

sys.path.insert(0, str(REPO))
from margingate.data.prompts import builtin_prompts  # noqa: E402

# policies of the mixed-policy clients: (label, body fields); `fast` and non-strict margin promise nothing
MIXED = [("auto", {"deterministic": True}), ("margin", {"determinism": {"policy": "margin"}}),
         ("dvr", {"determinism": {"policy": "dvr"}}), ("fast", {}),
         ("batch-invariant", {"determinism": {"policy": "batch-invariant"}}),
         ("reference", {"determinism": {"policy": "reference"}}),
         ("margin non-strict", {"determinism": {"policy": "margin", "strict": False}}),
         ("verify-all", {"determinism": {"policy": "verify-all"}})]
SYSTEM = ("You are a concise assistant for a team of engineers. Answer in plain sentences, state assumptions, "
          "and keep every answer under five sentences.")
TURNS = ["What does a load balancer do?", "Give one way it can fail.", "How would you detect that failure?"]


def is_deterministic(i: int, fraction: float) -> bool:
    """Evenly spread: request i is deterministic when floor((i+1)f) > floor(if)."""
    return math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)


def body_for(prompt, max_tokens: int, fields: dict) -> tuple[str, dict]:
    body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **fields}
    if prompt.kind == "chat":
        return "/v1/chat/completions", {**body, "messages": list(prompt.messages)}
    return "/v1/completions", {**body, "prompt": prompt.text}


def chat_body(messages: list[dict], max_tokens: int, fields: dict) -> tuple[str, dict]:
    return "/v1/chat/completions", {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                                    "messages": messages, **fields}


class Runner:
    """The HTTP side: streamed requests with their timings, requests alone, /metrics."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url, timeout
        self.alone_cache: dict[str, list[int]] = {}
        self.compared = self.mismatches = 0
        self.mismatch_examples: list[str] = []

    def client(self, n: int = 16) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=self.timeout,
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    async def metrics(self, client: httpx.AsyncClient) -> dict[str, float]:
        return scrape((await client.get("/metrics")).text)

    async def stream(self, client: httpx.AsyncClient, path: str, body: dict, stop_after: int | None = None) -> dict:
        """One streamed request: status, token ids, text, TTFT, latency, the determinism report, usage."""
        t0 = time.perf_counter()
        out = {"status": None, "ids": [], "text": "", "ttft": None, "latency": None, "report": None,
               "usage": None, "done": False, "error": None}
        try:
            async with client.stream("POST", path, json={**body, "stream": True}) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out["done"] = True
                        break
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["error"] = ev["error"].get("message")
                        continue
                    for c in ev.get("choices", []):
                        if c.get("token_ids") and out["ttft"] is None:
                            out["ttft"] = time.perf_counter() - t0
                        out["ids"] += c.get("token_ids") or []
                        out["text"] += (c.get("delta") or {}).get("content") or c.get("text") or ""
                    out["report"] = ev.get("determinism", out["report"])
                    out["usage"] = ev.get("usage") or out["usage"]
                    if stop_after is not None and len(out["ids"]) >= stop_after:
                        return out  # leaving the block closes the connection: a disconnect
        except httpx.HTTPError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["latency"] = time.perf_counter() - t0
        return out

    async def alone(self, client: httpx.AsyncClient, path: str, body: dict) -> list[int]:
        """The same request sent alone (non-streamed), once per distinct body."""
        key = json.dumps([path, body], sort_keys=True)
        if key not in self.alone_cache:
            r = await client.post(path, json=body)
            r.raise_for_status()
            self.alone_cache[key] = r.json()["choices"][0]["token_ids"]
        return self.alone_cache[key]

    async def check_alone(self, client: httpx.AsyncClient, runs: list[tuple[str, dict, dict]], what: str) -> dict:
        """Compare each guaranteed response with the request alone; returns counts for the report."""
        compared = identical = 0
        for path, body, res in runs:
            report = res["report"] or {}
            if res["status"] != 200 or not report.get("guaranteed"):
                continue
            compared += 1
            want = await self.alone(client, path, body)
            if res["ids"] == want:
                identical += 1
            elif len(self.mismatch_examples) < 5:
                asked = body.get("messages") or body.get("prompt")
                self.mismatch_examples.append(f"{what}: {report.get('policy')} {str(asked):.80}")
        self.compared += compared
        self.mismatches += compared - identical
        return {"compared_with_alone": compared, "identical": identical}


async def traffic_mix(run: Runner, prompts, fraction: float, args) -> dict:
    """Streamed requests from `concurrency` clients; request i is deterministic when i falls in the fraction."""
    sem = asyncio.Semaphore(args.concurrency)
    async with run.client(args.concurrency + 2) as client:
        before = await run.metrics(client)
        bodies = [body_for(prompts[i % len(prompts)], args.max_tokens,
                           {"deterministic": True} if is_deterministic(i, fraction) else {})
                  for i in range(args.requests)]

        async def one(path, body):
            async with sem:
                return await run.stream(client, path, body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p, b) for p, b in bodies))
        wall = time.perf_counter() - t0
        after = await run.metrics(client)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        check = await run.check_alone(client, [(p, b, r) for (p, b), r in zip(bodies, results)],
                                      f"{fraction:.0%} mix")
    return {"deterministic_fraction": fraction,
            "deterministic_requests": sum(1 for _, b in bodies if b.get("deterministic")),
            **summarize(results, wall, delta), **check}


async def mixed_policies(run: Runner, prompts, args) -> dict:
    """8 concurrent streams, one per policy in MIXED, on held-in prompts; two waves with other prompts."""
    async with run.client() as client:
        bodies = [body_for(prompts[(7 * w + 3 * k) % len(prompts)], args.max_tokens, MIXED[k][1])
                  for w in range(2) for k in range(len(MIXED))]
        t0 = time.perf_counter()
        results = []
        for w in range(2):
            results += await asyncio.gather(*(run.stream(client, p, b) for p, b in bodies[w * 8:(w + 1) * 8]))
        wall = time.perf_counter() - t0
        check = await run.check_alone(client, [(p, b, r) for (p, b), r in zip(bodies, results)], "mixed policies")
    return {"clients": len(MIXED), "waves": 2, "policies": [m[0] for m in MIXED], **summarize(results, wall, {}),
            **check}


async def conversations(run: Runner, args) -> dict:
    """8 concurrent clients, each a 3-turn chat under one system prompt (its own policy); each turn's prompt
    is the previous turns with their answers, so its prefix is in the cache."""
    async with run.client() as client:
        before = await run.metrics(client)

        async def talk(k: int):
            label, fields = MIXED[k]
            messages, runs = [{"role": "system", "content": SYSTEM}], []
            for turn in TURNS:
                messages = [*messages, {"role": "user", "content": f"({label}) {turn}"}]
                path, body = chat_body(messages, args.max_tokens, fields)
                res = await run.stream(client, path, body)
                runs.append((path, body, res))
                messages = [*messages, {"role": "assistant", "content": res["text"]}]
            return runs

        t0 = time.perf_counter()
        runs = [r for conv in await asyncio.gather(*(talk(k) for k in range(len(MIXED)))) for r in conv]
        wall = time.perf_counter() - t0
        after = await run.metrics(client)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        cached = [((r["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) for _, _, r in runs]
        check = await run.check_alone(client, runs, "conversation")
    return {"clients": len(MIXED), "turns": len(TURNS), **summarize([r for _, _, r in runs], wall, delta),
            "turns_with_cached_prefix": sum(1 for c in cached if c), "cached_tokens_per_turn_mean":
            round(sum(cached) / len(cached), 1), **check}


async def shared_system_prompt(run: Runner, args) -> dict:
    """TTFT with a long system prompt: cold (a system prompt never sent) vs hit (the same system prompt, a
    new question); and the cold request again: a hit that must give the cold run's tokens."""
    filler = " ".join(f"Rule {i}: keep answers factual, cite the rule number, avoid speculation." for i in range(60))
    cold_t, hit_t, same = [], [], 0
    async with run.client() as client:
        for rep in range(args.ttft_reps):
            system = f"Session {rep}-{time.time_ns()}. {filler}"

            def req(question):
                return chat_body([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                 8, {"deterministic": True})
            cold = await run.stream(client, *req("What is rule 7 about?"))
            hit = await run.stream(client, *req("Summarize rule 12."))
            again = await run.stream(client, *req("What is rule 7 about?"))
            cold_t.append(cold["ttft"])
            hit_t.append(hit["ttft"])
            same += again["ids"] == cold["ids"] and bool(cold["ids"])
            cached = (hit["usage"] or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
            prompt_tokens = (hit["usage"] or {}).get("prompt_tokens")
    cold_med, hit_med = percentile(cold_t, 0.5), percentile(hit_t, 0.5)
    return {"system_prompt_tokens_about": prompt_tokens, "cached_tokens_on_hit": cached, "reps": args.ttft_reps,
            "ttft_cold_p50_s": cold_med, "ttft_hit_p50_s": hit_med,
            "ttft_factor": round(cold_med / hit_med, 2) if cold_med and hit_med else None,
            "hit_equals_cold_tokens": f"{same}/{args.ttft_reps}"}


async def disconnects(run: Runner, prompts, args) -> dict:
    """Streams that go away after their first tokens: how long until every KV slot is free again."""
    n = args.max_num_seqs
    async with run.client(n + 2) as client:  # a connection per stream: httpx's pool would hold the rest back
        before = await run.metrics(client)
        bodies = [body_for(prompts[i], 400, {"deterministic": True} if i % 2 else {}) for i in range(n)]
        await asyncio.gather(*(run.stream(client, p, b, stop_after=1) for p, b in bodies))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 30:
            m = await run.metrics(client)
            if m.get("margingate_kv_blocks_used") == 0 and not m.get("margingate_in_flight_requests"):
                break
            await asyncio.sleep(0.02)
        freed = time.perf_counter() - t0
        delta = {k: m.get(k, 0.0) - before.get(k, 0.0) for k in m}
    return {"streams": n, "disconnects_counted": int(delta.get("margingate_client_disconnects_total", 0)),
            "all_blocks_free_after_s": round(freed, 3), "blocks_used": int(m.get("margingate_kv_blocks_used", -1))}


async def burst(run: Runner, prompts, args) -> dict:
    """capacity + extra requests at once: the extra get 429; every accepted one completes in full."""
    n = args.max_num_seqs + args.max_queue + args.burst_extra
    async with run.client(n + 2) as client:
        bodies = [body_for(prompts[i % len(prompts)], 16, {"deterministic": True}) for i in range(n)]
        results = await asyncio.gather(*(run.stream(client, p, b) for p, b in bodies))
        accepted = [r for r in results if r["status"] != 429]
        full = [r for r in accepted if r["status"] == 200 and r["done"] and len(r["ids"]) == 16]
        check = await run.check_alone(client, [(p, b, r) for (p, b), r in zip(bodies, results) if r in full], "burst")
    return {"sent": n, "capacity": args.max_num_seqs + args.max_queue,
            "status_429": sum(1 for r in results if r["status"] == 429), "accepted": len(accepted),
            "accepted_complete": len(full), "lost": len(accepted) - len(full), **check}


async def sigterm(run: Runner, proc: subprocess.Popen, prompts, args) -> dict:
    """SIGTERM while streams are generating: they finish; new requests are refused; the server exits 0."""
    n = args.max_num_seqs
    async with run.client(n + 2) as client:
        bodies = [body_for(prompts[i], args.max_tokens, {"deterministic": True} if i % 2 else {}) for i in range(n)]
        released = (await run.metrics(client)).get("margingate_generation_tokens_total", 0.0)
        tasks = [asyncio.ensure_future(run.stream(client, p, b)) for p, b in bodies]
        while (await run.metrics(client)).get("margingate_generation_tokens_total", 0.0) == released:
            await asyncio.sleep(0.05)  # until the streams are generating
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
    code = await asyncio.to_thread(proc.wait, 180)
    complete = sum(1 for r in results if r["status"] == 200 and r["done"] and len(r["ids"]) == args.max_tokens)
    return {"in_flight_at_sigterm": n, "completed_in_full": complete, "exit_code": code}


async def run_all(proc, url: str, args) -> dict:
    prompts = builtin_prompts()
    run = Runner(url, args.time_cap)
    async with run.client() as client:
        for i in range(args.warmup):  # first-use costs out of the measurement
            await run.stream(client, *body_for(prompts[i], 4, {"deterministic": True} if i % 2 else {}))
        info = (await client.get("/v1/models")).json()["data"][0]
    report: dict = {"auto_resolves_to": info["determinism"].get("default_policy_resolved"), "mixes": []}

    def log(name, r):
        print(f"{name}: {json.dumps(r)}", file=sys.stderr, flush=True)

    for f in args.fractions:
        report["mixes"].append(await traffic_mix(run, prompts, f, args))
        log(f"mix {f:.0%}", report["mixes"][-1])
    for name, step in (("mixed_policies", lambda: mixed_policies(run, prompts, args)),
                       ("conversations", lambda: conversations(run, args)),
                       ("shared_system_prompt", lambda: shared_system_prompt(run, args)),
                       ("disconnects", lambda: disconnects(run, prompts, args)),
                       ("burst", lambda: burst(run, prompts, args))):
        report[name] = await step()
        log(name, report[name])
    async with run.client() as client:
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "deterministic": True})
        report["environment"] = r.json()["determinism"]["environment"]
    report["sigterm"] = await sigterm(run, proc, prompts, args)
    log("sigterm", report["sigterm"])
    parts = [*report["mixes"], report["mixed_policies"], report["conversations"]]
    report["totals"] = {"compared": run.compared, "mismatches": run.mismatches,
                        "mismatch_examples": run.mismatch_examples,
                        "status_5xx": sum(p["status_5xx"] for p in parts),
                        "lost": report["burst"]["lost"] + sum(p["requests"] - p["completed"] for p in parts)
                        + report["sigterm"]["in_flight_at_sigterm"] - report["sigterm"]["completed_in_full"]}
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48, help="requests per traffic mix (fixed count)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--fractions", default="0,0.1,1", help="deterministic fractions, comma-separated")
    p.add_argument("--time-cap", type=float, default=300.0, help="seconds any one request may take")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--burst-extra", type=int, default=8, help="requests beyond the capacity in the burst")
    p.add_argument("--ttft-reps", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="server torch threads (default: all cores)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "results" / "load_test"), help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    args.fractions = [float(x) for x in args.fractions.split(",")]
    if not all(0 <= f <= 1 for f in args.fractions) or min(args.requests, args.concurrency, args.ttft_reps) < 1:
        p.error("fractions must be in [0, 1]; --requests, --concurrency and --ttft-reps >= 1")

    proc, url = start_server(args)
    try:
        report = asyncio.run(run_all(proc, url, args))
    finally:
        if proc.poll() is None:
            proc.kill()
    report = {"command": " ".join(["PYTHONPATH=. .venv/bin/python scripts/load_test.py",
                                   shlex.join(sys.argv[1:] if argv is None else argv)]).strip(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_avg_1m": os.getloadavg()[0],
              "config": {k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "time_cap",
                                                       "max_num_seqs", "max_queue", "burst_extra", "ttft_reps",
                                                       "max_model_len", "threads")},
              "host": {"cpu": cpu_name(), "cpus": os.cpu_count(), "machine": platform.machine(),
                       "python": platform.python_version()}, **report}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    t = report["totals"]
    return 0 if not (t["mismatches"] or t["status_5xx"] or t["lost"] or report["sigterm"]["exit_code"]) else 1


if __name__ == "__main__":
    sys.exit(main())
