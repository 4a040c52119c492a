"""Engines for the table: one per batch size, recording forwards as CUDA graphs where it can.

A capture that fails must not cost the slot: the run is repeated on an eager engine of the same batch size,
which that batch size keeps from then on, and the lane says why (`Lane.note`, copied into every point it
served). On CPU (the dry run) the graphs' stand-in runs: the same buckets and buffers, eagerly.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..engine import Request
from ..engine.engine import Engine, EngineConfig
from ..engine.sequence import Result
from ..models.decoder import DecoderModel
from ..options import PolicySpec
from ..policies import build


def sync() -> None:
    """Wait for the GPU, so a clock read after a run counts the run's kernels."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_engine(model: DecoderModel, batch: int, max_len: int, graphs: str) -> Engine:
    # every prompt of a batch prefills in one forward, so a timed run's prefill is its first step alone
    config = EngineConfig(max_num_seqs=batch, max_model_len=max_len, step_graphs=graphs,
                          max_num_batched_tokens=max(4096, batch * max_len))
    return Engine(model, config, lambda: build(PolicySpec("fast")))


@dataclass
class Run:
    """One `generate` call: its results, its wall time (GPU synchronized) and its prefill forwards' time."""
    results: list[Result]
    seconds: float
    prefill_seconds: float

    @property
    def tokens(self) -> list[list[int]]:
        return [r.token_ids for r in self.results]


@dataclass
class Lane:
    """The engine of one batch size and how its forwards run."""
    engine: Engine
    graphs: str                 # "cuda" (captured), "stand-in" (CPU) or "off" (eager)
    note: str = ""              # why it is eager when graphs were asked for

    def record(self) -> dict:
        recorded = self.engine.runner.graphs.recorded if self.engine.runner.graphs is not None else 0
        return {"graphs": self.graphs, "recorded_shapes": recorded, **({"note": self.note} if self.note else {})}


@dataclass
class Lanes:
    """One engine per batch size over one model, made on first use."""
    model: DecoderModel
    max_len: int
    graphs: str                 # what to ask for: "cuda", "stand-in" or "off"
    lanes: dict[int, Lane] = field(default_factory=dict)

    def lane(self, batch: int) -> Lane:
        if batch not in self.lanes:
            self.lanes[batch] = Lane(make_engine(self.model, batch, self.max_len, self.graphs), self.graphs)
        return self.lanes[batch]

    def run(self, batch: int, requests: Callable[[], list[Request]]) -> Run:
        """`requests()` on the batch size's engine. If it fails there with graphs on, the lane turns eager
        and the run is repeated once (fresh requests: a failed run leaves its policies' state behind)."""
        lane = self.lane(batch)
        try:
            return timed(lane.engine, requests())
        except Exception as exc:  # noqa: BLE001  (a capture failure of any kind: eager says whether it was one)
            if lane.graphs == "off":
                raise
            sync()
            note = f"graphs failed ({type(exc).__name__}: {str(exc)[:160]}); eager from then on"
            print(f"[graphs] B={batch}: {note}", flush=True)
            self.lanes[batch] = Lane(make_engine(self.model, batch, self.max_len, "off"), "off", note)
            return timed(self.lanes[batch].engine, requests())


def timed(engine: Engine, requests: list[Request]) -> Run:
    before = engine.totals["prefill"].seconds
    sync()
    t = time.perf_counter()
    results = engine.generate(requests)
    sync()
    return Run(results, time.perf_counter() - t, engine.totals["prefill"].seconds - before)


def requests_of(ids: list[list[int]], new: int, policy: PolicySpec | Callable, tag: str,
                arrivals: bool = False) -> list[Request]:
    """A request per prompt under `policy` (a spec, or a factory of policy objects); with `arrivals`, two
    requests join per engine step, so batches change as they run."""
    make = (lambda: build(policy)) if isinstance(policy, PolicySpec) else policy
    return [Request(x, new, make(), ignore_eos=True, request_id=f"{tag}{i}", arrival_step=i // 2 if arrivals else 0)
            for i, x in enumerate(ids)]
