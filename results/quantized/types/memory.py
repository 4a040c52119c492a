"""Resident memory of ours and llama.cpp on the same GGUF files, measured the same way (issue 64).

Each contender runs in a fresh process: it loads the file, greedily decodes the same prompts one at a time
(B = 1, EOS ignored), then reads its own /proc/self/status: VmRSS after the runs (steady), VmHWM (the peak
since the process began), and VmRSS split into anonymous pages (RssAnon) and file pages (RssFile). A mapped
file's pages count once touched, on both sides: llama.cpp maps the GGUF, ours maps its packed cache file. Ours
runs twice: the first load of the file (an empty packed cache, so it packs, writes the cache and maps it) and
a later load (a hit). The baseline row is a process that only imports torch: the runtime ours carries and
llama.cpp does not. Writes memory.json and memory.md beside this script.

    .venv/bin/python results/quantized/types/memory.py FILE.gguf [FILE.gguf ...] [--prompts 4] [--tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
FIELDS = {"VmRSS": "steady", "VmHWM": "peak", "RssAnon": "anon", "RssFile": "file"}


def status() -> dict:
    """This process's resident memory, MB (FIELDS)."""
    out = {}
    for line in open("/proc/self/status"):
        key, *rest = line.split()
        if key[:-1] in FIELDS:
            out[FIELDS[key[:-1]]] = int(rest[0]) / 1024
    return out


def child_ours(model: str, prompts: int, tokens: int) -> dict:
    import torch

    from margingate.data.prompts import builtin_prompts
    from margingate.llm import LLM
    llm = LLM(model, policy="batch-invariant")
    ids = [llm.tokenizer.encode_prompt(p) for p in builtin_prompts()[:prompts]]
    outs = [llm.generate([p], max_new_tokens=tokens, ignore_eos=True)[0].token_ids
            for p in builtin_prompts()[:prompts]]
    return {**status(), "prompt_ids": ids, "tokens": sum(map(len, outs)), "threads": torch.get_num_threads()}


def child_llamacpp(model: str, ids: list[list[int]], tokens: int, threads: int) -> dict:
    sys.path.insert(0, str(ROOT / "margingate" / "peers"))  # the bench's worker: llama-cpp-python only
    from llamacpp_worker import Decoder
    longest = max(map(len, ids))
    dec = Decoder(model, 1, context=longest + tokens + 1, prefill=longest, threads=threads)
    outs = [dec.group([p], tokens)[0] for p in ids]
    return {**status(), "tokens": sum(map(len, outs)), "threads": threads}


def child_torch() -> dict:
    import torch  # noqa: F401  (the runtime alone)
    return status()


def run(python: str, args: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run([python, __file__, "--child", *args], env=env, stdout=subprocess.PIPE, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def empty_packed_cache(tmp: Path) -> dict:
    """The environment of a first load: a cache whose every folder is the real one's but `packed/`, empty (the
    kernels and the GGUF's converted config and tokenizer are not what this measures)."""
    from margingate.paths import cache_root
    tmp.mkdir(parents=True, exist_ok=True)
    for entry in cache_root().iterdir():
        if entry.name != "packed":
            (tmp / entry.name).symlink_to(entry)
    return {**os.environ, "MARGINGATE_CACHE": str(tmp)}


def measure(model: str, prompts: int, tokens: int) -> dict:
    py, llama = sys.executable, os.environ.get("MARGINGATE_LLAMACPP_PYTHON", str(ROOT / ".venv-llamacpp/bin/python"))
    common = [model, str(prompts), str(tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        first = run(py, ["ours", *common], empty_packed_cache(Path(tmp) / "cache"))
    later = run(py, ["ours", *common])
    job = Path(tempfile.mkstemp(suffix=".json")[1])
    job.write_text(json.dumps(later["prompt_ids"]))
    try:
        peer = run(llama, ["llamacpp", model, str(job), str(tokens), str(later["threads"])])
    finally:
        job.unlink()
    return {"file": model, "file_mb": Path(model).stat().st_size / 2**20, "prompts": prompts, "tokens": tokens,
            "ours first load": first, "ours later load": later, "llama.cpp": peer, "import torch": run(py, ["torch"])}


def markdown(rows: list[dict]) -> str:
    head = ("| file | process | steady MB (VmRSS) | peak MB (VmHWM) | anonymous MB | file pages MB |\n"
            "|---|---|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        for name in ("ours first load", "ours later load", "llama.cpp", "import torch"):
            m = r[name]
            lines.append(f"| {Path(r['file']).name} ({r['file_mb']:,.0f} MiB) | {name} | {m['steady']:,.0f} | "
                         f"{m['peak']:,.0f} | {m['anon']:,.0f} | {m['file']:,.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        if kind == "ours":
            got = child_ours(rest[0], int(rest[1]), int(rest[2]))
        elif kind == "llamacpp":
            got = child_llamacpp(rest[0], json.loads(Path(rest[1]).read_text()), int(rest[2]), int(rest[3]))
        else:
            got = child_torch()
        print(json.dumps(got))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(HERE / "memory"))
    a = p.parse_args()
    rows = [measure(f, a.prompts, a.tokens) for f in a.files]
    Path(a.out + ".json").write_text(json.dumps(rows, indent=1))
    Path(a.out + ".md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
