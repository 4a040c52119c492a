"""`margingate check`: does a policy keep the determinism contract?

Every prompt is decoded alone by the `reference` policy (the verifier's
kernels: the trajectory the contract promises). Then the policy under test
decodes it inside homogeneous batches (the prompt replicated), heterogeneous
batches (with other prompts) at each size, and in one continuous-batching run
with staggered arrivals; each output is compared token by token.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Callable

from tqdm import tqdm

from ..data.prompts import Prompt
from ..engine import Request
from ..engine.policy import Policy
from ..llm import LLM
from .compare import Judgement

MODES = ("hetero", "homo", "staggered")
GATED = {"margin", "verify-all", "dvr"}  # policies with a trigger / repair to report


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown check mode(s) {bad or text!r} (choose from {', '.join(MODES)})")
    return modes


def _batches(n: int, size: int, mode: str) -> list[list[int]]:
    """Prompt indices per batch. hetero: consecutive prompts, wrapping so every batch is full."""
    if mode == "homo":
        return [[i] * size for i in range(n)]
    return [[(start + j) % n for j in range(size)] for start in range(0, n, size)]


class Checker:
    def __init__(self, llm: LLM, prompts: list[Prompt], make_policy: Callable[[], Policy],
                 reference: Callable[[], Policy], max_new_tokens: int = 128, progress: bool = True):
        self.llm, self.prompts, self.make_policy = llm, prompts, make_policy
        self.max_new_tokens, self.progress = max_new_tokens, progress
        self.ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
        self.reference_policy = reference
        self.reference: list[list[int]] = []

    def _run(self, indices: list[int], policy_factory, arrivals: list[int] | None = None, batch: int | None = None):
        reqs = [Request(self.ids[i], self.max_new_tokens, policy_factory(), request_id=f"c{k}",
                        arrival_step=arrivals[k] if arrivals else 0) for k, i in enumerate(indices)]
        engine = self.llm.engine
        if batch is not None and batch > engine.config.max_batch_size:
            raise ValueError(f"batch size {batch} exceeds the engine's max_batch_size {engine.config.max_batch_size}")
        return engine.generate(reqs)

    def run(self, batch_sizes: list[int], modes: list[str]) -> dict:
        t0 = time.perf_counter()
        bar = tqdm(total=len(self.ids), desc="reference (alone)", disable=not self.progress)
        for i in range(len(self.ids)):
            self.reference.append(self._run([i], self.reference_policy)[0].token_ids)
            bar.update()
        bar.close()
        t_ref = time.perf_counter() - t0
        groups: dict[tuple[str, int], list] = defaultdict(list)
        plan = [(mode, b) for b in batch_sizes for mode in modes if mode != "staggered"]
        for mode, size in tqdm(plan, desc="batched runs", disable=not self.progress):
            t = time.perf_counter()
            for batch in _batches(len(self.ids), size, mode):
                for i, res in zip(batch, self._run(batch, self.make_policy, batch=size)):
                    groups[(mode, size)].append((i, res))
            groups[(mode, size)].append(("time", time.perf_counter() - t))
        if "staggered" in modes:
            t = time.perf_counter()
            n = len(self.ids)
            order = list(range(n)) * 2  # each prompt twice, at different moments and neighbours
            arrivals = [3 * k for k in range(len(order))]
            for i, res in zip(order, self._run(order, self.make_policy, arrivals)):
                groups[("staggered", self.llm.engine.config.max_batch_size)].append((i, res))
            groups[("staggered", self.llm.engine.config.max_batch_size)].append(("time", time.perf_counter() - t))
        return self._summarise(groups, t_ref)

    def _summarise(self, groups, t_ref: float) -> dict:
        runs_all, per = [], defaultdict(dict)
        for (mode, size), items in groups.items():
            seconds = sum(v for k, v in items if k == "time")
            runs = [(i, r) for i, r in items if i != "time"]
            rows = [self._judge(i, r) for i, r in runs]
            runs_all += rows
            per[size][mode] = {**_rates(rows, self.policy_name), "seconds": round(seconds, 2)}
        # Every output token, in run order: equal digests mean equal token ids (across thread counts).
        outputs = [[mode, size, i, r.token_ids] for (mode, size), items in sorted(groups.items())
                   for i, r in items if i != "time"]
        digest = hashlib.sha256(json.dumps([self.reference, outputs]).encode()).hexdigest()
        return {"runs": len(runs_all), **_rates(runs_all, self.policy_name),
                "tokens_sha256": digest, "reference_seconds": round(t_ref, 2),
                "per_batch_size": {str(k): v for k, v in sorted(per.items())}}

    def _judge(self, i: int, res) -> dict:
        j = Judgement.of(self.reference[i], res.token_ids)
        return {"prompt_index": i, "identical": j.identical, "divergence": j.divergence,
                "synchronous_steps": j.synchronous_steps, "stats": res.stats}

    @property
    def policy_name(self) -> str:
        return self.make_policy().name


def _rates(rows: list[dict], policy: str) -> dict:
    n = len(rows)
    sync = sum(r["synchronous_steps"] for r in rows)
    flips = sum(not r["identical"] for r in rows)
    steps = sum(r["stats"]["steps"] for r in rows)
    gated = policy in GATED
    total = lambda key: sum(r["stats"].get(key, 0) for r in rows)  # noqa: E731
    return {
        "runs": n,
        "sequence_determinism": (n - flips) / n if n else None,
        "flips": flips, "synchronous_steps": sync,
        "flip_rate": flips / sync if sync else None,
        "trigger_rate": total("triggers") / steps if gated and steps else None,
        "repair_rate": total("repairs") / steps if gated and steps else None,
        "replay_rate": total("replayed_tokens") / steps if gated and steps else None,
        "rollbacks": total("rollbacks") if gated else None,
        "decode_steps": steps,
    }


def format_table(report: dict) -> str:
    head = f"{'batch':>5} {'mode':<10} {'runs':>5} {'seq.det':>8} {'flips':>6} {'flip rate':>10} " \
           f"{'trigger':>8} {'repair':>8} {'replay':>8} {'rollbk':>7} {'time s':>7}"
    lines = [f"policy {report['policy']}  ({report.get('settings', {})})", head, "-" * len(head)]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for size, modes in report["per_batch_size"].items():
        for mode, r in modes.items():
            lines.append(f"{size:>5} {mode:<10} {r['runs']:>5} {pct(r['sequence_determinism']):>8} {r['flips']:>6} "
                         f"{pct(r['flip_rate']):>10} {pct(r['trigger_rate']):>8} {pct(r['repair_rate']):>8} "
                         f"{pct(r['replay_rate']):>8} {'-' if r['rollbacks'] is None else r['rollbacks']:>7} "
                         f"{r['seconds']:>7}")
    lines.append("-" * len(head))
    lines.append(f"{'all':>5} {'':<10} {report['runs']:>5} {pct(report['sequence_determinism']):>8} "
                 f"{report['flips']:>6} {pct(report['flip_rate']):>10} {pct(report['trigger_rate']):>8} "
                 f"{pct(report['repair_rate']):>8} {pct(report['replay_rate']):>8}")
    env = report.get("environment", {})
    lines.append(f"token ids sha256 {report['tokens_sha256'][:16]} (references and every run); "
                 f"{env.get('num_threads')} threads, {env.get('cpu')} ({', '.join(env.get('cpu_isa', []))})")
    return "\n".join(lines)
