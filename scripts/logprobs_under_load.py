"""Logprobs and samples that do not depend on the load, against a live `margingate serve`:

1. a `batch-invariant` completion with `logprobs: 5` (top 5), alone, then while 8 clients stream
   (scripts/stream_load.py), then streamed; and `margingate score` of its output (a separate process);
2. `n: 4, temperature: 1, top_p: 0.9, seed: 7`, alone and under the same load, and each sample's
   single-request twin (seed 7 + i).
Every comparison is bitwise (the JSON floats as the server printed them).

    .venv/bin/python scripts/logprobs_under_load.py [--out results/logprobs-check]
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / ".venv" / "bin"
BI = {"determinism": {"policy": "batch-invariant"}, "ignore_eos": True}
PROMPT = "Explain in two sentences why the sea is salty."


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([str(BIN / "margingate"), "serve", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("no /health after 600 s")


def logprobs_request(client) -> dict:
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=32, logprobs=5, extra_body=BI)
    c = r.choices[0]
    return {"ids": c.model_extra["token_ids"], "logprobs": c.logprobs.token_logprobs, "top": c.logprobs.top_logprobs}


def streamed_logprobs(client) -> list:
    chunks = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=32, logprobs=5, stream=True,
                                       extra_body=BI)
    return [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]


def samples(client, n: int, seed: int) -> list:
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=24, n=n, temperature=1.0,
                                  top_p=0.9, seed=seed, extra_body=BI)
    return [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]


def scored(prompt_ids: list[int], ids: list[int]) -> list:
    line = json.dumps({"prompt_ids": prompt_ids, "continuation_ids": ids})
    out = subprocess.run([str(BIN / "margingate"), "score", "--file", "/dev/stdin"], input=line + "\n",
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["logprobs"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/logprobs-check")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(port)
    load = None
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        alone, samples_alone = logprobs_request(client), samples(client, 4, 7)
        twins = [samples(client, 1, 7 + i)[0] for i in range(4)]
        load = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "stream_load.py"), "--base-url",
                                 f"http://127.0.0.1:{port}/v1", "--clients", "8"], stdout=subprocess.PIPE, text=True)
        time.sleep(5)
        loaded, samples_loaded = logprobs_request(client), samples(client, 4, 7)
        load.terminate()
        load_line = load.communicate(timeout=600)[0].strip().splitlines()[-1]
        load = None
        streamed = streamed_logprobs(client)
        prompt_ids = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=0, echo=True,
                                               logprobs=0).choices[0].model_extra["prompt_token_ids"]
        score = scored(prompt_ids, alone["ids"])
    finally:
        for proc in (load, server):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    checks = {"logprobs: under 8 streaming clients = alone": loaded == alone,
              "logprobs: streamed = alone": streamed == alone["logprobs"],
              "logprobs: `margingate score` of the output = alone": score == alone["logprobs"],
              "n=4 samples: under load = alone": samples_loaded == samples_alone,
              "n=4 samples: sample i = the single request with seed 7 + i": twins == samples_alone,
              "n=4 samples: not all the same": len({tuple(s) for s in samples_alone}) > 1}
    report = {"checks": checks, "load": load_line, "tokens": len(alone["ids"]), "logprobs": alone["logprobs"],
              "samples": samples_alone}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(load_line)
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
