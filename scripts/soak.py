"""Soak test of `margingate serve` (issue 47): N clients for D minutes of mixed traffic, interleaved at random.

    PYTHONPATH=. .venv/bin/python scripts/soak.py --minutes 3 --clients 8 --out results/soak

Starts `margingate serve` on loopback (or uses `--url`; give `--pid` for its memory), then:

1. alone-runs: each distinct request of the pool (7 shapes x `--pool` prompts) sent once, not streamed,
   under `reference`, with no other traffic. The contract says every deterministic policy gives the
   request's tokens and logprobs alone, which are reference's alone, so one alone-run per request content
   serves every policy (a stronger check than comparing a policy with itself);
2. the soak: each client draws its next request from its own generator, seeded by `--seed` and its index:
   a completion, a chat, a chat with a `response_format` json_schema, a chat with tools (a named function,
   or `auto`), a Responses answer (`/v1/responses`: text, or function tools named or `auto`), under
   reference, batch-invariant, margin, dvr or fast (speculating at times under the first two), streamed or
   not; a bad request (malformed JSON, an unknown policy, negative max_tokens, a previous_response_id: each
   must be a 4xx); or a stream cancelled after a few tokens;
3. each answer whose report says `guaranteed` is compared with its alone-run: token ids, their count, text,
   tool calls (streamed: the argument fragments joined), logprobs and finish reason, bitwise (a Response
   carries no ids: its count of output tokens, text, its text's logprobs, calls and status).

It reports requests sent and served, 4xx, 5xx, deterministic answers checked / equal (also per shape) and the
server's VmRSS (/proc/PID/status; OUT/soak.json, OUT/soak.md): at start; after the alone-runs and `--idle-s`
seconds idle (the baseline); once idle after the soak and `--idle-s` seconds later (the end: an idle server
hands its free heap pages back after a second, margingate/server/core/heap.py, so both ends are measured alike),
and every `--rss-every` seconds throughout (the curve, OUT/rss.png: a plateau or a slope). Exit 1 on a 5xx, a mismatch,
an unexpected status, a lost answer, or a server not idle once the clients stop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import REPO, cpu_name, start_server  # noqa: E402
from soak_client import Answer, gauges, post, stream  # noqa: E402
from soak_memory import MemoryLog, curve_table, memory_rows, memory_summary  # noqa: E402

POLICIES = {"reference": {"determinism": {"policy": "reference"}},
            "batch-invariant": {"determinism": {"policy": "batch-invariant"}},
            "margin": {"determinism": {"policy": "margin"}}, "dvr": {"determinism": {"policy": "dvr"}},
            "fast": {}}  # fast promises nothing: its answers are counted, not checked
SPECULATING = ("reference", "batch-invariant")  # the deterministic policies that speculate
SHAPES = ("completion", "chat", "json_schema", "tool_named", "tool_auto", "responses", "responses_tool")
TEXT_SHAPES = ("completion", "chat", "responses")  # the shapes that speculate at times
TOPICS = ["rivers", "the moon", "bread", "volcanoes", "owls", "glass", "maps", "bees"]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Tunis"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
             "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat form
# bad requests: each must be refused with a 4xx, never a 5xx
BAD = {"malformed_json": ("/v1/completions", b'{"prompt": "x", "max_tokens": '),
       "unknown_policy": ("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                              "determinism": {"policy": "no-such-policy"}}),
       "negative_max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": -3}),
       "responses_previous_id": ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"})}
ACTIONS, WEIGHTS = ("answer", "bad", "cancel"), (0.8, 0.1, 0.1)


def responses_request(shape: str, k: int, max_tokens: int) -> tuple[str, dict]:
    """A Responses request, its text's logprobs asked for as chat's are: `input` a string for even k, message
    items for odd; `responses_tool` with the tools in the Responses form, calling get_weather by name for even k and
    choosing (`auto`) for odd."""
    ask = f"Tell me one fact about {TOPICS[k]}." if shape == "responses" else f"What is the weather in {CITIES[k]}?"
    given = ask if k % 2 == 0 else [{"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": ask}]}]
    body = {"input": given, "max_output_tokens": max_tokens, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    if shape == "responses_tool":
        body.update(tools=RESPONSES_TOOLS,
                    tool_choice={"type": "function", "name": "get_weather"} if k % 2 == 0 else "auto")
    return "/v1/responses", body


def long_document(k: int, pool: int, tokens: int) -> str:
    """Prompt k of the long shape: a log of distinct records, about tokens * (k + 1) / pool tokens (2.4 characters a
    token on SmolLM2's vocabulary: the records are mostly digits), so the pool spans short to `tokens` long."""
    want, lines, i = 12 * tokens * (k + 1) // (5 * pool), [], 0
    while sum(map(len, lines)) < want:
        lines.append(f"Record {k}-{i}: {TOPICS[(i * 3 + k) % len(TOPICS)]} seen near {CITIES[(i * 5) % len(CITIES)]}, "
                     f"{(i * 37 + k) % 1000} units.\n")
        i += 1
    return "".join(lines) + "The last record says:"


def request(shape: str, k: int, max_tokens: int, long_tokens: int = 0, pool: int = 1) -> tuple[str, dict]:
    """Request k of `shape`, greedy, with logprobs where the API has them, without a policy or `stream`:
    (path, body)."""
    if shape == "long":
        return "/v1/completions", {"prompt": long_document(k, pool, long_tokens), "max_tokens": max_tokens,
                                   "logprobs": 2}
    if shape.startswith("responses"):
        return responses_request(shape, k, max_tokens)
    if shape == "completion":
        return "/v1/completions", {"prompt": f"Three short facts about {TOPICS[k]}:", "max_tokens": max_tokens,
                                   "logprobs": 2}
    body = {"max_tokens": max_tokens, "logprobs": True, "top_logprobs": 2}
    if shape == "chat":
        ask = f"Tell me one fact about {TOPICS[k]}."
    elif shape == "json_schema":
        ask = f"Give me a person who studies {TOPICS[k]}, as JSON with a name and an age."
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    else:
        ask = f"What is the weather in {CITIES[k]}?"
        named = {"type": "function", "function": {"name": "get_weather"}}
        body.update(tools=TOOLS, tool_choice=named if shape == "tool_named" else "auto")
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": ask}]}


class Soak:
    """The counts, the alone-runs and the three actions a client draws from."""

    def __init__(self, client: httpx.AsyncClient, args):
        self.client, self.args = client, args
        self.counts: Counter = Counter()
        self.statuses: Counter = Counter()
        self.policies: Counter = Counter()
        self.by_shape: dict[str, Counter] = {}  # "shape" or "shape stream" -> checked, equal
        self.alone: dict[tuple[str, int], Answer] = {}
        self.problems: list[str] = []
        # the long shape, when asked for, as likely as all the others together
        self.shapes = SHAPES + ("long",) * len(SHAPES) if args.long_tokens else SHAPES

    def request(self, shape: str, k: int) -> tuple[str, dict]:
        return request(shape, k, self.args.max_tokens, self.args.long_tokens, self.args.pool)

    def problem(self, what: str) -> None:
        self.counts["problems"] += 1
        if len(self.problems) < 20:
            self.problems.append(what)

    def tally(self, a: Answer, what: str, refused: bool = False) -> None:
        """Status counts; `refused`: a 4xx is the right answer (a bad request)."""
        self.counts["requests"] += 1
        self.statuses[str(a.status) if a.status is not None else "no response"] += 1
        if a.status is not None and a.status >= 500:
            self.counts["5xx"] += 1
        if a.status is not None and 400 <= a.status < 500:
            self.counts["4xx"] += 1
        if a.status == 200:
            self.counts["served"] += 1
            self.counts["tokens"] += a.tokens
        right = a.status is not None and (400 <= a.status < 500 if refused else a.status == 200)
        if not right:
            self.problem(f"{what}: status {a.status} {a.error or ''}")

    async def alone_runs(self, pool: int) -> None:
        """Every distinct request once, alone, under reference (no other traffic yet)."""
        todo = [(shape, k) for shape in dict.fromkeys(self.shapes) for k in range(pool)]
        for shape, k in tqdm(todo, desc="alone-runs", unit="req"):
            path, body = self.request(shape, k)
            a = await post(self.client, path, {**body, **POLICIES["reference"]})
            if a.status != 200:
                raise SystemExit(f"the alone-run of {shape} {k} failed: {a.status} {a.error}")
            self.alone[shape, k] = a

    async def answer(self, rng: random.Random) -> None:
        shape, k, policy = rng.choice(self.shapes), rng.randrange(self.args.pool), rng.choice(list(POLICIES))
        path, body = self.request(shape, k)
        body = {**body, **POLICIES[policy]}
        if policy in SPECULATING and shape in TEXT_SHAPES and rng.random() < 0.25:
            body["speculative"] = {"method": "ngram"}
        streamed = rng.random() < 0.5
        a = await (stream(self.client, path, body) if streamed else post(self.client, path, body))
        what = f"{shape} {k} {policy}{' stream' if streamed else ''}"
        self.tally(a, what)
        self.policies[policy] += 1
        if a.status != 200:
            return
        if not a.done or a.error:
            self.problem(f"{what}: lost ({a.error})")
        elif (a.report or {}).get("guaranteed") != (policy != "fast"):
            self.problem(f"{what}: guaranteed is {(a.report or {}).get('guaranteed')}")
        elif policy != "fast":
            differs = a.differs(self.alone[shape, k])
            tally = self.by_shape.setdefault(f"{shape}{' stream' if streamed else ''}", Counter())
            for counts in (self.counts, tally):
                counts["checked"] += 1
                counts["equal"] += not differs
            if differs:
                self.problem(f"{what}: {differs} differ from its alone-run")

    async def bad(self, rng: random.Random) -> None:
        kind = rng.choice(list(BAD))
        self.counts["bad_requests"] += 1
        self.tally(await post(self.client, *BAD[kind]), f"bad {kind}", refused=True)

    async def cancel(self, rng: random.Random) -> None:
        shape, k = rng.choice(SHAPES[:2]), rng.randrange(self.args.pool)
        path, body = request(shape, k, self.args.max_tokens)
        a = await stream(self.client, path, {**body, **POLICIES[rng.choice(list(POLICIES))]},
                         cancel_after=rng.randint(1, 4))
        self.tally(a, f"cancelled {shape} {k}")
        self.counts["cancelled"] += a.status == 200 and not a.done

    async def client_loop(self, i: int, deadline: float) -> None:
        rng = random.Random(f"{self.args.seed}:{i}")
        while time.monotonic() < deadline:
            action = rng.choices(ACTIONS, WEIGHTS)[0]
            try:
                await getattr(self, action)(rng)
            except Exception as exc:  # a broken answer is a finding, not the end of the soak
                self.problem(f"{action}: {type(exc).__name__}: {exc}")


async def progress(soak: Soak, seconds: float, deadline: float) -> None:
    with tqdm(total=round(seconds), desc="soak", unit="s") as bar:
        while True:
            left = deadline - time.monotonic()
            bar.n = min(bar.total, round(seconds - max(0.0, left)))
            c = soak.counts
            bar.set_postfix(served=c["served"], s4xx=c["4xx"], s5xx=c["5xx"], checked=c["checked"],
                            equal=c["equal"], problems=c["problems"], refresh=False)
            bar.refresh()
            if left <= 0:
                return
            await asyncio.sleep(min(1.0, left))


async def idle_health(client: httpx.AsyncClient, wait_s: float = 120.0) -> dict:
    """/health once nothing is in flight (or after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        health = (await client.get("/health")).json()
        if health["in_flight"] == 0 or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.5)


async def run(url: str, pid: int | None, args) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    memory, stop = MemoryLog(pid, args.rss_every), asyncio.Event()
    sampler = asyncio.create_task(memory.run(stop))
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        soak, rss = Soak(client, args), {"start": memory.mark("alone-runs")}
        await soak.alone_runs(args.pool)
        memory.mark("idle after alone-runs")
        await asyncio.sleep(args.idle_s)  # the baseline: warmed up, then idle as long as at the end
        rss["after_alone_runs"], served = memory.mark("soak"), {"after_alone_runs": await gauges(client)}
        seconds = args.minutes * 60
        t0 = time.monotonic()
        deadline = t0 + seconds
        await asyncio.gather(progress(soak, seconds, deadline),
                             *(soak.client_loop(i, deadline) for i in range(args.clients)))
        wall = time.monotonic() - t0  # the clients finish the requests in flight at the deadline
        health = await idle_health(client)
        rss["at_idle"] = memory.mark("idle")
        await asyncio.sleep(args.idle_s)  # what the idle server keeps
        rss["end"], served["end"] = memory.mark("end"), await gauges(client)
    stop.set()
    await sampler
    return {**summary(soak, health, wall, args), **memory_summary(memory, rss), "memory": memory,
            "server_metrics": served}


def summary(soak: Soak, health: dict, wall: float, args) -> dict:
    c = soak.counts
    idle = health["in_flight"] == 0 and (args.url is not None or health["kv_blocks_used"] == 0)
    return {"seconds": round(wall, 1), "requests": c["requests"], "served": c["served"],
            "tokens_served": c["tokens"], "status_4xx": c["4xx"], "status_5xx": c["5xx"],
            "statuses": dict(sorted(soak.statuses.items())), "bad_requests": c["bad_requests"],
            "cancelled_streams": c["cancelled"], "answers_by_policy": dict(sorted(soak.policies.items())),
            "alone_runs": len(soak.alone),
            "alone_mode": "each distinct request once under reference, not streamed, before any other traffic; "
                          "every guaranteed answer (any deterministic policy, streamed or not) compared with it",
            "deterministic_checked": c["checked"], "deterministic_equal": c["equal"],
            "checked_equal_by_shape": {k: [v["checked"], v["equal"]] for k, v in sorted(soak.by_shape.items())},
            "problems": c["problems"], "problem_examples": soak.problems,
            "health_at_end": {k: health.get(k) for k in ("status", "in_flight", "running", "queued", "kv_blocks_used")},
            "ok": c["5xx"] == 0 and c["problems"] == 0 and c["checked"] == c["equal"] and idle}


def table(report: dict) -> str:
    rows = [("clients x minutes", f"{report['config']['clients']} x {report['config']['minutes']}"),
            ("seconds", report["seconds"]), ("requests sent", report["requests"]),
            ("served (200)", report["served"]), ("tokens served", report["tokens_served"]),
            ("4xx", f"{report['status_4xx']} (bad requests sent: {report['bad_requests']})"),
            ("5xx", report["status_5xx"]), ("cancelled streams", report["cancelled_streams"]),
            ("deterministic checked / equal to alone",
             f"{report['deterministic_checked']} / {report['deterministic_equal']}"),
            ("problems", report["problems"]),
            *memory_rows(report),
            ("server idle at end", report["health_at_end"]), ("ok", report["ok"])]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join([f"`{report['command']}`", "", *lines, "",
                      f"statuses: {report['statuses']}; answers by policy: {report['answers_by_policy']}",
                      "", "deterministic answers checked / equal to alone, by shape:", "",
                      *(f"- {k}: {c} / {e}" for k, (c, e) in report["checked_equal_by_shape"].items()), "",
                      *(f"- {p}" for p in report["problem_examples"]), "",
                      f"VmRSS over time (every {report['rss_samples']['every_s']:g} s; rss.png):", "",
                      *curve_table(report["rss_samples"]["samples"])]) + "\n"


def stop_server(proc: subprocess.Popen) -> int | None:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", type=int, default=6, help=f"prompts per shape (at most {len(TOPICS)})")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one request may take")
    p.add_argument("--url", default=None, help="a running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for its VmRSS")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="server torch threads (default: all cores)")
    p.add_argument("--long-tokens", type=int, default=0,
                   help="add a shape of long completions (prompts up to about this many tokens; half the answers)")
    p.add_argument("--kv-cache-memory", type=float, default=None, metavar="GB",
                   help="the server's K/V pool (small: forces preemption)")
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between VmRSS samples")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="seconds idle before the baseline VmRSS (after the alone-runs) and before the last one")
    p.add_argument("--out", default=str(REPO / "results" / "soak"), help="writes OUT/soak.json, OUT/soak.md")
    args = p.parse_args(argv)
    if not (1 <= args.pool <= len(TOPICS)) or args.clients < 1 or args.minutes <= 0:
        p.error(f"--pool in [1, {len(TOPICS)}], --clients >= 1, --minutes > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc, url, pid = None, args.url, args.pid
    if url is None:
        with open(out / "server.log", "w") as log:
            extra = ("--kv-cache-memory", str(args.kv_cache_memory)) if args.kv_cache_memory else ()
            proc, url = start_server(args, stderr=log, extra=extra)
        pid = proc.pid
    try:
        report = asyncio.run(run(url, pid, args))
    finally:
        exit_code = stop_server(proc) if proc is not None else None
    report = {"command": " ".join(["PYTHONPATH=. .venv/bin/python scripts/soak.py",
                                   shlex.join(sys.argv[1:] if argv is None else argv)]).strip(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_avg_1m": os.getloadavg()[0],
              "config": {k: getattr(args, k) for k in ("clients", "minutes", "seed", "pool", "max_tokens",
                                                       "max_num_seqs", "max_queue", "max_model_len", "threads",
                                                       "rss_every", "idle_s", "long_tokens", "kv_cache_memory")},
              "host": {"cpu": cpu_name(), "cpus": os.cpu_count(), "machine": platform.machine()},
              "server_exit_code": exit_code, **report}
    report["ok"] = report["ok"] and (proc is None or exit_code == 0)
    memory = report.pop("memory")
    report["rss_samples"] = memory.report()
    memory.plot(out / "rss.png", f"margingate serve VmRSS: {args.clients} clients x {args.minutes:g} min, "
                                 f"{report['host']['cpu']}")
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "soak.md").write_text(table(report))
    print(table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
