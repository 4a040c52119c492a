"""Offline scale-out: groups of requests run on a pool of Ray actors, one engine per actor.

A *group* is what one `engine.generate` call gets: a shard of `generate`'s prompts, or one
batch (or one staggered stream) of a `check` plan, never split, so a batch's composition is
the same as in a local run. Each actor builds its engine exactly as the command would locally
(`cli_args.llm`), with `threads_per_worker` torch threads: its core budget.

Fault tolerance: every group is tracked until its results come back; a group whose actor died
goes back to the queue and runs again, whole, on a fresh actor. A group's results are kept
only once, and only if they answer exactly the group's requests, so nothing is lost or
duplicated. Results come back in input order.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter, deque
from itertools import islice

from tqdm import tqdm

from .. import cli_args
from ..engine import Request, Result
from . import require_ray

MAX_RETRIES = 3  # per group: a group that kills its worker this often is a bug, not bad luck


class RayEngineActor:
    """The body of one Ray actor: one engine, built from the command's own arguments."""

    def __init__(self, args: argparse.Namespace, max_num_seqs: int, threads: int):
        self.llm = cli_args.llm(argparse.Namespace(**{**vars(args), "threads": threads}), max_num_seqs)

    def generate(self, requests: list[Request], crash_after: int | None = None) -> list[Result]:
        if crash_after is not None:  # testing: die mid-group, after some engine steps' tokens
            for _ in islice(self.llm.engine.stream(requests), crash_after):
                pass
            os._exit(1)
        return self.llm.engine.generate(requests)

    def environment(self) -> dict:
        return self.llm.environment()


class WorkerPool:
    """`workers` actors of `threads` CPUs each on the connected Ray cluster (see options.connect)."""

    def __init__(self, args: argparse.Namespace, *, workers: int, threads: int, max_num_seqs: int,
                 max_retries: int = MAX_RETRIES):
        self.ray = require_ray("--ray")
        self.args, self.workers, self.num_threads = args, workers, threads
        self.max_num_seqs, self.max_retries = max_num_seqs, max_retries
        self.crash_next: int | None = None  # testing: the next group submitted kills its worker
        self.restarts = 0
        # max_restarts=0: a dead actor stays dead; the pool replaces it and re-runs its group itself.
        self._actor = self.ray.remote(num_cpus=threads, max_restarts=0)(RayEngineActor)
        self.actors = [self._spawn() for _ in range(workers)]

    def _spawn(self):
        return self._actor.remote(self.args, self.max_num_seqs, self.num_threads)

    # --- running ---------------------------------------------------------------------
    def run(self, groups: list[list[Request]], desc: str = "requests", progress: bool = True) -> list[list[Result]]:
        """Each group on one engine, groups spread over the actors; results per group, in order."""
        ray = self.ray
        from ray.exceptions import RayActorError

        results: list[list[Result] | None] = [None] * len(groups)
        todo, idle, running, tries = deque(range(len(groups))), list(self.actors), {}, Counter()
        bar = tqdm(total=sum(map(len, groups)), desc=f"{desc} on {self.workers} Ray workers", unit="req",
                   disable=not progress, leave=False)
        while todo or running:
            while todo and idle:
                actor, g = idle.pop(0), todo.popleft()
                crash, self.crash_next = self.crash_next, None
                running[actor.generate.remote(groups[g], crash)] = (actor, g)
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, g = running.pop(ref)
            try:
                out = ray.get(ref)
            except RayActorError as exc:  # the worker died: its group runs again, whole, on a fresh one
                tries[g] += 1
                if tries[g] > self.max_retries:
                    raise RuntimeError(f"a group of {len(groups[g])} requests killed {tries[g]} Ray workers; "
                                       f"giving up: {exc}") from exc
                print(f"warning: a Ray worker died ({type(exc).__name__}); re-running its "
                      f"{len(groups[g])} requests on a fresh worker", file=sys.stderr)
                self.actors[self.actors.index(actor)] = fresh = self._spawn()
                self.restarts += 1
                idle.append(fresh)
                todo.appendleft(g)
                continue
            asked, answered = [r.request_id for r in groups[g]], [r.request_id for r in out]
            if asked != answered or results[g] is not None:
                raise RuntimeError(f"group {g}: asked for {asked}, answered {answered}")
            results[g] = out
            idle.append(actor)
            bar.update(len(out))
        bar.close()
        return results

    def generate(self, requests: list[Request], progress: bool = False) -> list[Result]:
        """Like `Engine.generate`: the requests in shards over the actors, results in input order."""
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique within one generate call")
        size = max(1, min(self.max_num_seqs, math.ceil(len(requests) / self.workers)))
        shards = [requests[s:s + size] for s in range(0, len(requests), size)]
        return [res for shard in self.run(shards, "prompts", progress) for res in shard]

    def environment(self) -> dict:
        """A worker's environment (what the contract depends on), and the pool's shape."""
        env = self.ray.get(self.actors[0].environment.remote())
        nodes = {n["NodeManagerAddress"] for n in self.ray.nodes() if n.get("Alive")}
        return {**env, "ray": {"workers": self.workers, "threads_per_worker": self.num_threads,
                               "nodes": len(nodes), "restarts": self.restarts}}

    def shutdown(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
