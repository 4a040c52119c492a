"""`margingate serve` as a subprocess for the scripts that load it (load_test.py, soak.py): a free loopback
port, the server started and waited for, its /metrics parsed, the host's CPU named for the report."""
from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, stderr=subprocess.PIPE, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`margingate serve` on a free loopback port, once /health answers; `stderr`: where its log goes (a
    file for a long run: a pipe nobody reads fills and blocks the server); `extra`: more serve flags."""
    port = free_port()
    cmd = [sys.executable, "-m", "margingate", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-queue", str(args.max_queue),
           "--max-model-len", str(args.max_model_len), "--log-level", "warning", "--shutdown-timeout", "120"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += list(extra)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MARGINGATE_API_KEY", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = proc.stderr.read()[-2000:] if proc.stderr else ""
            raise SystemExit(f"the server exited ({proc.returncode}): {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not come up within 300 s")


def scrape(text: str) -> dict[str, float]:
    """Sum of every series of each metric (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if line.startswith("#") or not m or "_bucket" in m.group(1):
            continue
        try:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        except ValueError:
            pass
    return out


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "?").strip()
    family = fields.get("CPU family", "").strip()
    flags = fields.get("Flags", "").split()
    zen = {"25": "Zen 3/4", "26": "Zen 5"}.get(family, "") if "AMD" in name else ""
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}{f' ({zen})' if zen else ''}, {', '.join(isa)}"
