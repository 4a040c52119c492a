"""Embeddings: sentences per second at batch 32 beside sentence-transformers, bitwise alone = batched, cosine to
the oracle, per model. Run it under the measurement lock:

    flock /tmp/mg-measure.lock python results/embeddings/bench.py            # writes results.json, README table

Every contender runs at 2 torch threads in this one process, on the same 32 sentences (the built-in prompts).
sentence-transformers (`pip install sentence-transformers`) runs the same model files: MiniLM's folder as
shipped; nomic from transformers' NomicBertModel on the GGUF's F16 weights, saved as a folder (Transformer,
mean Pooling, Normalize). Without it, transformers + the same pooling by hand stands in (named so).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from margingate.data.prompts import builtin_prompts
from margingate.embeddings import files_of, load, sources
from margingate.embeddings.oracle import oracle_vectors, transformers_model

HERE = Path(__file__).parent
THREADS, BATCH, REPEATS = 2, 32, 3
TEXTS = [p.text or p.messages[-1]["content"] for p in builtin_prompts()][:BATCH]


def cpu_name() -> str:
    """lscpu's model name and the ISA flags the kernels pick paths by."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    name = next((x.split(":", 1)[1].strip() for x in info if x.startswith("Model name:")), platform.processor())
    flags = next((x.split(":", 1)[1].split() for x in info if x.startswith("Flags:")), [])
    isa = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(isa) or 'AVX2'}; {os.cpu_count()} cores)"


def rate(fn) -> float:
    """Sentences per second: the median of REPEATS timed calls of a 32-sentence batch, after one warm-up."""
    fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return BATCH / statistics.median(times)


def peer(name: str, files, folder: Path):
    """sentence-transformers on the same files, or transformers + pooling by hand where it is not installed."""
    try:
        from sentence_transformers import SentenceTransformer, models
    except ImportError:
        model = transformers_model(files, as_file=True)
        return "transformers + mean pooling (sentence-transformers not installed)", lambda: oracle_vectors(
            model, [files.tokenizer.encode(t).ids for t in TEXTS])
    if name == "all-minilm-l6-v2":
        st = SentenceTransformer(str(folder), device="cpu")
    else:  # nomic: transformers' class on the GGUF's weights, saved as a folder sentence-transformers reads
        transformers_model(files, as_file=True).save_pretrained(folder)
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=files.tokenizer, cls_token="[CLS]", sep_token="[SEP]",
                                pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
        body = models.Transformer(str(folder), max_seq_length=files.max_tokens)
        st = SentenceTransformer(modules=[body, models.Pooling(files.config.hidden, "mean"), models.Normalize()],
                                 device="cpu")
    return "sentence-transformers", lambda: torch.from_numpy(st.encode(TEXTS, batch_size=BATCH))


def one_model(name: str, tmp: Path) -> dict:
    files = files_of(name)
    folder = tmp / name
    if name == "all-minilm-l6-v2":
        with sources.minilm_zip(name) as archive:
            archive.extractall(folder)
    ids = [files.tokenizer.encode(t).ids for t in TEXTS]
    oracle = oracle_vectors(transformers_model(files), ids, files.pooling, files.normalize)
    as_file = oracle_vectors(transformers_model(files, as_file=True), ids, files.pooling, files.normalize)
    row = {"model": name, "tokens": sum(map(len, ids)), "rows": {}}
    for dtype in (torch.float32, torch.bfloat16):
        e = load(name, dtype)
        vectors = e.embed(ids).vectors
        alone = torch.stack([e.embed([t]).vectors[0] for t in ids])
        cos, cos_file = F.cosine_similarity(vectors, oracle, dim=-1), F.cosine_similarity(vectors, as_file, dim=-1)
        row["rows"][f"margingate {str(dtype).removeprefix('torch.')}"] = {
            "sentences_per_s": rate(lambda e=e: e.embed(ids)),
            "bitwise_alone_equals_batched": f"{sum(torch.equal(a, b) for a, b in zip(alone, vectors))}/{len(ids)}",
            "cosine_to_oracle_min": cos.min().item(), "cosine_to_oracle_mean": cos.mean().item(),
            "cosine_to_file_weights_min": cos_file.min().item()}
    label, run = peer(name, files, folder)
    theirs = run()
    row["rows"][label] = {"sentences_per_s": rate(run),
                          "cosine_to_file_weights_min": F.cosine_similarity(theirs, as_file, dim=-1).min().item()}
    return row


def table(result: dict) -> str:
    lines = [f"CPU: {result['cpu']}, {THREADS} torch threads each, batch {BATCH} (the built-in prompts), "
             f"torch {result['torch']}.", "",
             "| model | contender | sentences/s | alone = batched (bits) | cosine to oracle, min (mean) | "
             "cosine to the file's weights, min |", "|---|---|---|---|---|---|"]
    for m in result["models"]:
        for label, r in m["rows"].items():
            oracle = (f"{r['cosine_to_oracle_min']:.6f} ({r['cosine_to_oracle_mean']:.6f})"
                      if "cosine_to_oracle_min" in r else "-")
            lines.append(f"| {m['model']} | {label} | {r['sentences_per_s']:.1f} | "
                         f"{r.get('bitwise_alone_equals_batched', '-')} | {oracle} | "
                         f"{r['cosine_to_file_weights_min']:.6f} |")
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(THREADS)
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        models = [one_model(n, Path(tmp)) for n in sources.NAMED if sources.installed(n)]
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    result = {"cpu": cpu_name(), "torch": torch.__version__, "threads": THREADS, "batch": BATCH,
              "uptime_before_after": uptime, "models": models}
    (HERE / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (HERE / "table.md").write_text(table(result) + "\n")
    print(table(result))
    print("\n".join(uptime), file=sys.stderr)


if __name__ == "__main__":
    main()
