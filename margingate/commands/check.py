"""`margingate check`: does a policy keep the determinism contract?

Every prompt is decoded alone by the `reference` policy (the verifier's kernels:
the trajectory the contract promises). Then the policy under test decodes it
inside homogeneous batches (the prompt replicated), heterogeneous batches (with
other prompts) at each size, and in one continuous-batching run with staggered
arrivals; each output is compared token by token.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import cli_args
from ..analysis.compare import judge, summary
from ..analysis.outputs import machine_line, percent
from ..analysis.runs import CachedRuns, batches, staggered
from ..data.prompts import Prompt
from ..distributed.options import add_ray_args, worker_pool
from ..options import PolicySpec

if TYPE_CHECKING:  # the facade and the policies load the model stack: only when the command runs
    from ..engine.policy import Policy
    from ..llm import LLM

MODES = ("hetero", "homo", "staggered")
#: what check reports per (batch size, mode) and over all runs
RATE_KEYS = ("runs", "sequence_determinism", "flips", "synchronous_steps", "flip_rate", "trigger_rate",
             "repair_rate", "replay_rate", "rollbacks", "decode_steps")


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown check mode(s) {bad or text!r} (choose from {', '.join(MODES)})")
    return modes


class Checker:
    def __init__(self, llm: LLM, prompts: list[Prompt], make_policy: Callable[[], Policy],
                 reference: Callable[[], Policy], max_new_tokens: int = 128, progress: bool = True, pool=None):
        self.llm, self.prompts, self.make_policy = llm, prompts, make_policy
        self.max_new_tokens, self.progress = max_new_tokens, progress
        self.ids = [llm.tokenizer.encode_prompt(p) for p in prompts]
        self.reference_policy = reference
        self.reference: list[list[int]] = []
        # pool (a distributed WorkerPool): each batch or staggered stream runs whole on one of its workers
        self.runner = CachedRuns(llm, self.ids, max_new_tokens, ignore_eos=False, progress=progress, pool=pool)

    def _spec(self, policy: Policy, mode: str, size: int) -> dict:
        return {"kind": "check", "policy": policy.name, **policy.settings(), "mode": mode, "size": size}

    def run(self, batch_sizes: list[int], modes: list[str]) -> dict:
        t0 = time.perf_counter()
        n, reference = len(self.ids), self.reference_policy()
        run = self.runner.run(self._spec(reference, "alone", 1), batches(n, 1, "alone"),
                              lambda i, r: (self.reference_policy(), None), "reference (alone)")
        self.reference = [tokens for _, tokens, _, _ in run["rows"]]
        t_ref = time.perf_counter() - t0
        policy, make = self.make_policy(), lambda i, r: (self.make_policy(), None)
        runs = {}
        for size in batch_sizes:
            for mode in modes:
                if mode != "staggered":
                    runs[(mode, size)] = self.runner.run(self._spec(policy, mode, size), batches(n, size, mode),
                                                         make, f"{mode} b={size}")
        if "staggered" in modes:
            size = self.llm.engine.config.max_num_seqs
            order, arrivals = staggered(n)  # each prompt twice, at different moments and neighbours
            runs[("staggered", size)] = self.runner.run(self._spec(policy, "staggered", size), [order], make,
                                                        "staggered", arrivals=[arrivals])
        return self._summarise(runs, t_ref)

    def _summarise(self, runs: dict, t_ref: float) -> dict:
        judged_all, per = [], defaultdict(dict)
        for (mode, size), run in runs.items():
            judged = judge(self.reference, run["rows"])
            judged_all += judged
            per[size][mode] = {**summary(judged, RATE_KEYS, self.verifies), "seconds": round(run["seconds"], 2)}
        # Every output token, in run order: equal digests mean equal token ids (across thread counts).
        outputs = [[mode, size, i, tokens] for (mode, size), run in sorted(runs.items())
                   for i, tokens, _, _ in run["rows"]]
        digest = hashlib.sha256(json.dumps([self.reference, outputs]).encode()).hexdigest()
        return {**summary(judged_all, RATE_KEYS, self.verifies),
                "tokens_sha256": digest, "reference_seconds": round(t_ref, 2),
                "per_batch_size": {str(k): v for k, v in sorted(per.items())}}

    @property
    def policy_name(self) -> str:
        return self.make_policy().name

    @property
    def verifies(self) -> bool:
        """Does the policy under test gate and verify (so its trigger and repair rates mean something)?"""
        return self.make_policy().verifies


def format_table(report: dict) -> str:
    head = f"{'batch':>5} {'mode':<10} {'runs':>5} {'seq.det':>8} {'flips':>6} {'flip rate':>10} " \
           f"{'trigger':>8} {'repair':>8} {'replay':>8} {'rollbk':>7} {'time s':>7}"
    lines = [f"policy {report['policy']}  ({report.get('settings', {})})", head, "-" * len(head)]
    for size, modes in report["per_batch_size"].items():
        for mode, r in modes.items():
            lines.append(f"{size:>5} {mode:<10} {_rates_cells(r)} "
                         f"{'-' if r['rollbacks'] is None else r['rollbacks']:>7} {r['seconds']:>7}")
    lines.append("-" * len(head))
    lines.append(f"{'all':>5} {'':<10} {_rates_cells(report)}")
    env = report.get("environment", {})
    lines.append(f"token ids sha256 {report['tokens_sha256'][:16]} (references and every run); "
                 f"{machine_line(env)}")
    return "\n".join(lines)


def _rates_cells(r: dict) -> str:
    return (f"{r['runs']:>5} {percent(r['sequence_determinism']):>8} {r['flips']:>6} {percent(r['flip_rate']):>10} "
            f"{percent(r['trigger_rate']):>8} {percent(r['repair_rate']):>8} {percent(r['replay_rate']):>8}")


# --- `margingate check` ----------------------------------------------------------------

def add_parser(sub) -> None:
    c = sub.add_parser("check", help="does a policy give the reference tokens whatever shares its batch?")
    cli_args.add_prompt_args(c, 16)
    c.add_argument("--batch-sizes", type=cli_args.int_list, default=[4, 16])
    c.add_argument("--modes", default="hetero,homo,staggered", help="any of hetero,homo,staggered")
    c.add_argument("--max-new-tokens", type=cli_args.positive_int, default=128)
    c.add_argument("--json", action="store_true")
    c.add_argument("--out", help="also write the JSON report here")
    cli_args.add_model_args(c)
    cli_args.add_policy_args(c, "margin")
    add_ray_args(c)
    c.set_defaults(func=cmd_check)


def cmd_check(args) -> None:
    modes = parse_modes(args.modes)
    spec = cli_args.policy_spec(args)
    prompts = cli_args.prompts(args)
    with worker_pool(args, max(args.batch_sizes)) as pool:  # --ray: each batch runs whole on one worker
        llm = cli_args.llm(args, max(args.batch_sizes))
        # The trajectory each policy promises. A policy that promises none (fast, layercast) is judged
        # against itself alone (its kernels differ from the reference's, so comparing it with the
        # reference would count kernels or precision, not batching, as flips).
        ref = PolicySpec("reference", verifier_precision=spec.verifier_precision) if spec.deterministic else spec
        make, reference = (lambda: llm.policy(spec)), (lambda: llm.policy(ref))
        t0 = time.perf_counter()
        report = Checker(llm, prompts, make, reference, args.max_new_tokens, progress=not args.json,
                         pool=pool).run(args.batch_sizes, modes)
        environment = (pool or llm).environment()  # with --ray: a worker's, and the pool's shape
    report = {"policy": spec.name, "chosen_by": spec.chosen_by, "settings": make().settings(),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes,
              "modes": modes,
              "environment": environment, "seconds": round(time.perf_counter() - t0, 1), **report}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report) if args.json else format_table(report))
