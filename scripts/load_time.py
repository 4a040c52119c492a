"""How long a model takes to start, first and again, beside llama.cpp's load of the same file.

Each start is a fresh process. A first start finds nothing in the cache: it converts the GGUF's config and
tokenizer (the tokenizer's snapshot taken as it is written), packs every matrix and writes the packed-weights
cache; a second start maps them. Each child reports its imports (`from margingate import llm`: torch, the
engine) and `LLM(model)` apart, and the share of the weights (load_state_dict, build_model) and of the tokenizer
(Tokenizer) in it; llama.cpp's child (llama-cpp-python's `import llama_cpp` and `Llama(model_path=...,
n_threads=2)`) the same two. The GGUF is in the page cache (read once before any timing), as it is for a model
started again. Writes results/load-time/load_time.json and load_time.md, `uptime` before and after.

    flock /tmp/mg-measure.lock env PYTHONPATH=$PWD .venv/bin/python scripts/load_time.py --model FILE.gguf \\
        --model smollm2-135m --llamacpp-python .venv-llamacpp/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from margingate.analysis.outputs import uptime

# One start of margingate, in a child process.
MARGINGATE = """
import json, sys, time
t0 = time.perf_counter()
from margingate import llm as facade
imported = time.perf_counter() - t0
parts = {"weights_s": 0.0, "tokenizer_s": 0.0, "convert_s": 0.0}  # LLM()'s largest shares
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
                    ("resolve_model_dir", "convert_s")):
    timed(name, share)
llm = facade.LLM(sys.argv[1], max_num_seqs=1)
loaded = time.perf_counter() - t0 - imported
t1 = time.perf_counter()
llm.generate("Hello", max_new_tokens=1)
print(json.dumps({"import_s": imported, "load_s": loaded, "weights_cache": llm.weights_cache, **parts,
                  "transformers_imported": "transformers" in sys.modules, "first_token_s": time.perf_counter() - t1}))
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


def forget(model: str) -> None:
    """Remove what a start of `model` leaves in the cache: its converted folder, tokenizer snapshot and packed
    weights (a named model's converted folder is kept: it is shared with every other use of the name)."""
    from margingate.models import tokenizer_snapshot
    from margingate.models.loader import converted_folder, gguf_parts
    from margingate.models.named import NAMED
    from margingate.models.packed_cache import PackedCache
    from margingate.paths import cache_root

    parts = gguf_parts(model)
    folder = converted_folder(parts) if model not in NAMED else None
    if folder is not None and folder.exists():
        shutil.rmtree(cache_root() / "tokenizers" / tokenizer_snapshot.key(folder), ignore_errors=True)
        shutil.rmtree(folder)
    cache = PackedCache.for_gguf(parts, "int8", cache_root())
    if cache is not None:
        cache.path.unlink(missing_ok=True)


def measure(model: str, repeats: int, llamacpp_python: str | None) -> dict:
    from margingate.models.loader import gguf_parts

    parts = gguf_parts(model)
    for p in parts:  # into the page cache, as for a model started before
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    out = {"model": model, "file_bytes": sum(p.stat().st_size for p in parts)}
    forget(model)
    out["first"] = run(sys.executable, MARGINGATE, model)
    out["second"] = [run(sys.executable, MARGINGATE, model) for _ in range(repeats)]
    if llamacpp_python:
        out["llamacpp"] = [run(llamacpp_python, LLAMACPP, str(parts[0])) for _ in range(repeats)]
    return out


def total(r: dict) -> float:
    return r["import_s"] + r["load_s"]


def table(report: dict) -> str:
    lines = [f"# Model start time: margingate vs llama.cpp\n\n{report['cpu']}, {report['cpus']} CPUs; medians of "
             f"{report['repeats']} fresh processes (a first start: one). uptime before: `{report['uptime_before']}`; "
             f"after: `{report['uptime_after']}`. A start = the imports + `LLM(model)` (margingate) or "
             "`Llama(model_path=...)` (llama.cpp); first: nothing cached (the GGUF's config and tokenizer converted, "
             "every matrix packed); second: the cache mapped. The GGUF is in the page cache.\n",
             "| model | file | first start: all (convert) | second start: import + LLM() (weights, tokenizer) "
             "| llama.cpp: import + Llama() | second / llama.cpp | transformers imported (second) |",
             "|---|---|---|---|---|---|---|"]
    for m in report["models"]:
        first, second = m["first"], m["second"]
        all2 = statistics.median(total(r) for r in second)
        imp, load = median(second, "import_s"), median(second, "load_s")
        ll = statistics.median(total(r) for r in m["llamacpp"]) if m.get("llamacpp") else None
        llp = f"{ll:.2f} s ({median(m['llamacpp'], 'import_s'):.2f} + {median(m['llamacpp'], 'load_s'):.2f})" \
            if ll else "-"
        lines.append(f"| {Path(m['model']).name} | {m['file_bytes'] / 2**20:.0f} MiB | {total(first):.2f} s "
                     f"({first['convert_s']:.2f} s) | {all2:.2f} s = {imp:.2f} + {load:.2f} "
                     f"({median(second, 'weights_s'):.2f} s, {median(second, 'tokenizer_s'):.2f} s; "
                     f"{second[0]['weights_cache']}) | {llp} | {f'{all2 / ll:.2f}x' if ll else '-'} | "
                     f"{any(r['transformers_imported'] for r in second)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="a .gguf file or a named model (repeatable)")
    ap.add_argument("--llamacpp-python", help="a Python with llama-cpp-python (make llamacpp-venv)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/load-time")
    ap.add_argument("--name", default="load_time", help="the files' stem: NAME.json and NAME.md")
    args = ap.parse_args()
    from margingate.environment import cpu_info

    report = {"cpu": cpu_info("model name"), "cpus": os.cpu_count(), "repeats": args.repeats,
              "uptime_before": uptime(), "date": time.strftime("%Y-%m-%d %H:%M"), "models": []}
    for model in args.model:
        report["models"].append(measure(model, args.repeats, args.llamacpp_python))
    report["uptime_after"] = uptime()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(table(report))
    print(table(report))


if __name__ == "__main__":
    main()
