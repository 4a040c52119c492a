"""The path of one chat request with `tool_choice` through the server: every function of `margingate/server` it
enters, in the order first entered, with the file it lives in and how often it ran, and the files it crosses.

A real server (uvicorn, the engine thread) on the embedded model; one non-streamed chat completion offering two
tools with a named `tool_choice`; Python's profiler hook on every thread records each call into a server
module (the app's start and shutdown are left out: only calls made while the request is in flight count).

    python scripts/request_path.py > results/server-rooms/path_after.md
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(ROOT / "margingate" / "server") + "/"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
BODY = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 64, "determinism": {"policy": "batch-invariant"}}


class Recorder:
    """Calls into server modules while `on`: (file, function) in order of first entry, and counts."""

    def __init__(self):
        self.on, self.order, self.calls, self.lock = False, [], Counter(), threading.Lock()

    def __call__(self, frame, event, arg):
        if event != "call" or not self.on or not frame.f_code.co_filename.startswith(SERVER):
            return
        code = frame.f_code
        if code.co_name.startswith("<"):  # comprehensions, lambdas, generator expressions
            return
        key = (code.co_filename[len(SERVER):], code.co_qualname)
        with self.lock:
            if key not in self.calls:
                self.order.append(key)
            self.calls[key] += 1


def run() -> Recorder:
    import httpx

    from margingate.llm import LLM
    from margingate.server.app import create_app
    from margingate.server.background import BackgroundServer

    record = Recorder()
    threading.setprofile(record)  # the uvicorn thread, the engine thread and the thread pool start after this
    sys.setprofile(record)
    srv = BackgroundServer(create_app(LLM(max_num_seqs=4, max_model_len=512))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            http.post("/v1/chat/completions", json=BODY).raise_for_status()  # warm: tokenizer, grammar compiler
            time.sleep(1.0)  # the first request's last tasks end before recording starts
            record.on = True
            answer = http.post("/v1/chat/completions", json=BODY)
            record.on = False
        answer.raise_for_status()
        assert answer.json()["choices"][0]["message"]["tool_calls"], answer.text
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        srv.stop()
    return record


def report(record: Recorder) -> str:
    files = list(dict.fromkeys(f for f, _ in record.order))
    lines = [f"{len(record.order)} functions entered, {sum(record.calls.values())} calls, {len(files)} files "
             "crossed (a function's count: how many times it ran for this one request).", "",
             "| # | file | function | calls |", "|---|---|---|---|"]
    lines += [f"| {i} | `{f}` | `{name}` | {record.calls[f, name]} |" for i, (f, name) in enumerate(record.order, 1)]
    lines += ["", "Files crossed, in order: " + " -> ".join(f"`{f}`" for f in files)]
    by_file = Counter()
    for (f, _), n in record.calls.items():
        by_file[f] += n
    lines += ["", "Calls per file: " + ", ".join(f"`{f}` {n}" for f, n in by_file.most_common())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(run()))
