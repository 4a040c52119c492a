"""How long a model takes to start: margingate's LLM() without the packed-weights cache (every matrix packed
at load, as before the cache), a first start (packs, writes the cache), and later starts (map the cache),
beside llama.cpp's load of the same file (llama-cpp-python's Llama(model_path=...)).

Each start is a fresh process; the times are taken inside it after its imports (the import times are
reported apart), and the GGUF is in the page cache (read once before any timing), as it is for a model
started again; an untimed start first converts the file's config and tokenizer (once per file, cached).
Writes results/load-time/load_time.json and load_time.md.

    PYTHONPATH=$PWD .venv/bin/python scripts/load_time.py --model FILE.gguf --model smollm2-135m \\
        --llamacpp-python .venv-llamacpp/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# One start of margingate, in a child process: "cache" as users run it, "nocache" with the packed-weights cache
# out of play (the load before it existed).
MARGINGATE = """
import json, sys, time
t0 = time.perf_counter()
from margingate import llm as facade
from margingate.models import packed_cache
imported = time.perf_counter() - t0
if sys.argv[2] == "nocache":
    packed_cache.MIN_BYTES = 1 << 62
parts = {"weights_s": 0.0, "tokenizer_s": 0.0}  # LLM()'s two largest shares
def timed(name, share):
    step = getattr(facade, name)
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            parts[share] += time.perf_counter() - t
    setattr(facade, name, run)
for name, share in (("load_state_dict", "weights_s"), ("build_model", "weights_s"), ("Tokenizer", "tokenizer_s"),
                    ("text_decoder", "tokenizer_s")):
    timed(name, share)
llm = facade.LLM(sys.argv[1], max_num_seqs=1)
t1 = time.perf_counter()
llm.generate("Hello", max_new_tokens=1)
print(json.dumps({"import_s": imported, "load_s": llm.load_seconds, "weights_cache": llm.weights_cache, **parts,
                  "first_token_s": time.perf_counter() - t1}))
"""
LLAMACPP = """
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
imported = time.perf_counter() - t0
t1 = time.perf_counter()
Llama(model_path=sys.argv[1], n_threads=2, verbose=False)
print(json.dumps({"import_s": imported, "load_s": time.perf_counter() - t1}))
"""


def run(python: str, code: str, *args: str) -> dict:
    t = time.perf_counter()
    done = subprocess.run([python, "-c", code, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a start failed ({python} {args}):\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t}


def median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 3)


def measure(model: str, repeats: int, llamacpp_python: str | None) -> dict:
    from margingate.models.loader import gguf_parts
    from margingate.models.packed_cache import PackedCache
    from margingate.paths import cache_root

    parts = gguf_parts(model)
    for p in parts:  # into the page cache, as for a model started before
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    out = {"model": model, "file_bytes": sum(p.stat().st_size for p in parts)}
    run(sys.executable, MARGINGATE, model, "nocache")  # untimed: converts the config and tokenizer (once per file)
    out["before"] = [run(sys.executable, MARGINGATE, model, "nocache") for _ in range(repeats)]
    cache = PackedCache.for_gguf(parts, "int8", cache_root())
    if cache is not None:
        cache.path.unlink(missing_ok=True)
    out["first"] = run(sys.executable, MARGINGATE, model, "cache")
    out["second"] = [run(sys.executable, MARGINGATE, model, "cache") for _ in range(repeats)]
    if llamacpp_python:
        out["llamacpp"] = [run(llamacpp_python, LLAMACPP, str(parts[0])) for _ in range(repeats)]
    return out


def table(report: dict) -> str:
    lines = [f"# Model start time: margingate vs llama.cpp\n\n{report['cpu']}, {report['cpus']} CPUs; "
             f"medians of {report['repeats']} fresh processes (a first start: one); load average "
             f"{report['load_average']} when it began. Load: `LLM(model)` / `Llama(model_path=...)` after their "
             "imports; weights: its load_state_dict and build_model (what the cache replaces); tokenizer: its "
             "Tokenizer and text_decoder; process: the whole child (imports, load, one token for margingate). "
             "The GGUF is in the page cache.\n",
             "| model | file | margingate before the cache (weights) | first start (packs, writes) | second start "
             "(maps): all (weights, tokenizer) | llama.cpp load | second / llama.cpp: all (weights) "
             "| process: second start / llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for m in report["models"]:
        before, second = median(m["before"], "load_s"), median(m["second"], "load_s")
        ll = median(m["llamacpp"], "load_s") if m.get("llamacpp") else None
        llp = median(m["llamacpp"], "process_s") if m.get("llamacpp") else None
        weights, tokenizer = median(m["second"], "weights_s"), median(m["second"], "tokenizer_s")
        lines.append(f"| {m['model'].rsplit('/', 1)[-1]} | {m['file_bytes'] / 2**20:.0f} MiB | {before:.2f} s "
                     f"({median(m['before'], 'weights_s'):.2f} s) | {m['first']['load_s']:.2f} s | {second:.2f} s "
                     f"({weights:.2f} s, {tokenizer:.2f} s; {m['second'][0]['weights_cache']}) | "
                     + (f"{ll:.2f} s | {second / ll:.1f}x ({weights / ll:.2f}x) | "
                        f"{median(m['second'], 'process_s'):.1f} s / {llp:.1f} s |" if ll else "- | - | - |"))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="a .gguf file or a named model (repeatable)")
    ap.add_argument("--llamacpp-python", help="a Python with llama-cpp-python (make llamacpp-venv)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/load-time")
    args = ap.parse_args()
    from margingate.environment import cpu_info

    report = {"cpu": cpu_info("model name"), "cpus": os.cpu_count(), "repeats": args.repeats,
              "load_average": " ".join(f"{v:.1f}" for v in os.getloadavg()), "date": time.strftime("%Y-%m-%d %H:%M"),
              "models": []}
    for model in args.model:
        report["models"].append(measure(model, args.repeats, args.llamacpp_python))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "load_time.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "load_time.md").write_text(table(report))
    print(table(report))


if __name__ == "__main__":
    main()
