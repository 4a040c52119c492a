"""Running prompts through the engine for a measurement: which prompts share a run, and a
runner (`CachedRuns`) that executes the runs and caches each finished one on disk.

Batch plans (prompt indices per run):
- hetero: consecutive prompts of the set, wrapping so that every batch is full;
- homo: one prompt replicated (`homo_limit` prompts at most);
- alone: each prompt by itself;
- chunks: consecutive prompts, the last batch possibly short (each prompt once);
- staggered: every prompt twice, one arriving every few steps, in one continuous-batching run.

A run's results are cached keyed by a hash of everything that determines them (the cache
format, the kernels' version, model fingerprint, prompt token ids, output length, EOS
handling, threads, torch, device, and the caller's `spec` of the policies and batches), so a
re-run with the same settings reuses finished work.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from .. import cli_args
from ..engine import Request
from ..environment import environment_record, kept_quantized
from ..paths import cache_root

CACHE_VERSION = "flips-v1"  # the format of a cached run (the name predates the other users)
PLANS = ("hetero", "homo", "alone", "chunks")


def batches(n: int, size: int, mode: str, homo_limit: int | None = None) -> list[list[int]]:
    """Prompt indices per batch (see the module docstring for the modes)."""
    if mode == "homo":
        return [[i] * size for i in range(min(n, homo_limit or n))]
    if mode == "alone":
        return [[i] for i in range(n)]
    if mode == "chunks":
        return [list(range(s, min(n, s + size))) for s in range(0, n, size)]
    if mode == "hetero":
        return [[(start + j) % n for j in range(size)] for start in range(0, n, size)]
    raise ValueError(f"unknown batch plan {mode!r} (choose from {', '.join(PLANS)})")


def staggered(n: int, copies: int = 2, every: int = 3) -> tuple[list[int], list[int]]:
    """Prompt indices and arrival steps: each prompt `copies` times (so at different moments and
    beside different neighbours), one request arriving every `every` steps."""
    order = list(range(n)) * copies
    return order, [every * k for k in range(len(order))]


def settings_key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


class CachedRuns:
    """Runs groups of requests on one LLM, caching each finished run under `cache_dir` (None: no cache).

    A row of a run is `(prompt index, token ids, stats, packed trace or None)`.
    """

    def __init__(self, llm, prompt_ids: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = True,
                 cache_dir: Path | None = None, progress: bool = True, tag: str = "", pool=None):
        self.llm, self.ids, self.max_new_tokens = llm, prompt_ids, max_new_tokens
        self.ignore_eos, self.progress, self.tag = ignore_eos, progress, tag
        self.pool = pool  # a distributed.offline.WorkerPool: groups run on its workers, not on llm.engine
        self.cache_dir = Path(cache_dir) if cache_dir else None
        env = environment_record(llm, (pool or llm.engine).num_threads)  # with a pool: a worker's threads
        # the key names and values predate the record: renaming them would orphan every cached run
        self.base = {"version": CACHE_VERSION, "kernels": env["kernels_version"], "model": env["model_fingerprint"],
                     "prompts": settings_key(prompt_ids), "max_new_tokens": max_new_tokens,
                     "ignore_eos": ignore_eos, "threads": env["num_threads"],
                     "torch": env["torch"], "device": env["device"],
                     **({"backend": "triton"} if env["kernels"] == "triton" else {}),
                     # a run is only reused with the storage and the quantized contract it ran on
                     **({"weights": env["weights"], "contract": env.get("quantized_contract")}
                        if kept_quantized(env) else {}),
                     # a folder quantized at load has other values than the folder, whatever holds them
                     **({"quantize": env["quantize"]} if env["quantize"] else {})}

    def key(self, spec: dict) -> str:
        return settings_key({**self.base, **spec})

    def _load(self, key: str):
        import torch  # the cache's format; imported here so that the commands' --help loads none

        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"{key}.pt"
        if path.exists():
            try:
                return torch.load(path, weights_only=False)
            except Exception:  # a broken cache file is recomputed
                return None
        return None

    def _save(self, key: str, value) -> None:
        import torch  # the cache's format; imported here so that the commands' --help loads none

        if self.cache_dir is None:
            return
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_dir / f"{key}.tmp"
        torch.save(value, tmp)
        tmp.replace(self.cache_dir / f"{key}.pt")

    def run(self, spec: dict, groups: list[list[int]], make: Callable[[int, int], tuple], desc: str = "",
            arrivals: list[list[int]] | None = None) -> dict:
        """Run every group in one `engine.generate`; `make(prompt index, row)` -> (policy, trace or None).

        Without `arrivals` a group is one batch, and may not exceed the engine's max_num_seqs;
        with them (one arrival step per request of each group) it is a stream of requests that the
        engine admits as they arrive and slots free up. Returns {"rows": [...], "seconds": time in
        the engine, "spec": spec, "cached": bool}. `spec` must describe everything the run depends
        on beyond the prompts and the runner's settings.
        """
        key = self.key(spec)
        hit = self._load(key)
        if hit is not None:
            hit["cached"] = True
            return hit
        engine = self.llm.engine
        if arrivals is None and max(len(g) for g in groups) > engine.config.max_num_seqs:
            raise ValueError(f"batch size {max(len(g) for g in groups)} exceeds the engine's "
                             f"max_num_seqs {engine.config.max_num_seqs}")
        made = [[make(i, r) for r, i in enumerate(g)] for g in groups]
        reqs = [[Request(self.ids[i], self.max_new_tokens, pol, ignore_eos=self.ignore_eos, request_id=f"r{r}",
                         arrival_step=arrivals[k][r] if arrivals else 0)
                 for r, (i, (pol, _)) in enumerate(zip(g, m))] for k, (g, m) in enumerate(zip(groups, made))]
        t = time.perf_counter()
        if self.pool is not None:  # every group whole on one worker: the same batches as here
            if any(trace is not None for m in made for _, trace in m):
                raise ValueError("traces are recorded in the engine's process: run traced measurements locally")
            outs = self.pool.run(reqs, f"{self.tag}{desc}", self.progress)
        else:
            outs = [engine.generate(r) for r in tqdm(reqs, desc=f"{self.tag}{desc}", disable=not self.progress,
                                                     leave=False)]
        seconds = time.perf_counter() - t
        rows = []
        for g, results, m in zip(groups, outs, made):
            for i, res, (_, trace) in zip(g, results, m):
                packed = None
                if trace is not None:
                    trace.tokens = list(res.token_ids)
                    packed = trace.pack()
                rows.append((i, list(res.token_ids), dict(res.stats), packed))
        out = {"rows": rows, "seconds": seconds, "spec": spec}
        self._save(key, out)
        out["cached"] = False
        return out


# --- the dataset runs of `flips` and `calibrate` ----------------------------------------

def load_prompts(llm, name: str, limit, seed, max_prompt_tokens):
    from ..data.datasets import dataset_prompts

    prompts = dataset_prompts(name, limit, seed, llm.tokenizer, max_prompt_tokens)
    if not prompts:
        raise ValueError(f"dataset {name!r}: no prompts left after filtering")
    return prompts


def add_run_args(p) -> None:
    """The dataset, output length, cache and model options of a cached measurement."""
    p.add_argument("--dataset", default="builtin",
                   help="humaneval, sharegpt, champ, builtin, or a JSON-lines file")
    p.add_argument("--limit", type=int, default=48, help="prompts (a deterministic subset)")
    p.add_argument("--seed", type=int, default=0, help="seed of the subset")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=400, help="skip longer prompts")
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: fixed length)")
    p.add_argument("--cache-dir", default=None, help="per-run cache (default: <margingate cache>/runs)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    cli_args.add_model_args(p)


def cache_dir_of(args) -> Path | None:
    if args.no_cache:
        return None
    if args.cache_dir:
        return Path(args.cache_dir)
    return cache_root() / "runs"
