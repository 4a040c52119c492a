"""One shape's table, in one process: the model is built once and serves calibration, check and every point.

Order: tau (the calibration prompts), the check, then the timed points in the order of `batch_sizes`. Each
is saved as it finishes; a resumed run skips what its folder's report already holds (the prompt sets are
drawn again from the same seed and must match). A point does not start when the part's deadline would pass
during it, judged by the last point's length; the report lists the points not reached and why.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.decoder import DecoderModel
from ..models.weights import streamed_bytes
from .calibration import fit_tau
from .engines import Lanes
from .protocol import bench_point, check, specs
from .shapes import SHAPE_KEYS, SHAPES, PromptSets, random_model
from .store import Clock, Store


@dataclass
class TableConfig:
    device: str                   # "cuda", or "cpu" (the dry run: Triton's interpreter)
    batch_sizes: list[int]
    new: int                      # new tokens per timed or checked request
    cal_new: int                  # new tokens per calibration request
    prompt_len: tuple[int, int]
    check_prompts: int
    window: int                   # dvr's W
    group: int                    # dvr's G
    warmup: int
    repeats: int
    cal_batches: int              # calibration batches per batch size
    cal_points: int               # taus swept at most
    graphs: str                   # "cuda", "stand-in" or "off"
    bandwidth: float              # bytes/s of a device copy (nan on CPU)


def floor_ms(model: DecoderModel, batch: int, context: int, bw: float) -> float:
    """Milliseconds to read the weights and the batch's K/V once at the given bandwidth (a decode step's floor)."""
    cfg = model.config
    kv = batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    return 1000 * (streamed_bytes(model.own_weights) + kv) / bw


def prepare(name: str, cfg: TableConfig, rep: dict) -> tuple[DecoderModel, PromptSets]:
    t0 = time.perf_counter()
    model = random_model(name, cfg.device)
    sets = PromptSets.draw(model.config.vocab_size, cfg.prompt_len,
                           (max(cfg.batch_sizes), cfg.check_prompts, max(cfg.batch_sizes)))
    if rep.get("prompt_sets", sets.fingerprints()) != sets.fingerprints():
        raise SystemExit(f"[{name}] the resumed report's prompts are not this run's: start a fresh folder")
    rep.update(shape=dict(zip(SHAPE_KEYS, SHAPES[name])), prompt_sets=sets.fingerprints(),
               build_seconds=time.perf_counter() - t0)
    return model, sets


def run_shape(name: str, cfg: TableConfig, store: Store, clock: Clock) -> None:
    """Fill the report's entry for `name`, saving after each part."""
    rep = store.report["shapes"].setdefault(name, {})
    model, sets = prepare(name, cfg, rep)
    max_len = cfg.prompt_len[1] + max(cfg.new, cfg.cal_new) + 16
    lanes, eager = Lanes(model, max_len, cfg.graphs), Lanes(model, max_len, "off")
    if "tau" not in rep:
        t = time.perf_counter()
        rep["tau"] = store.stamp(fit_tau(lanes, sets.calibration, cfg.cal_new, cfg.batch_sizes, cfg.cal_batches,
                                         cfg.cal_points) | {"seconds": time.perf_counter() - t})
        print(f"[{name}] tau {rep['tau']['tau']:.4g} ({rep['tau']['rule']}; {rep['tau']['flips']} flips; "
              f"qualified {rep['tau']['qualified']})", flush=True)
        store.save()
    policies = specs(rep["tau"]["tau"], cfg.window, cfg.group)
    if "check" not in rep:
        t = time.perf_counter()
        done = check(lanes, eager, sets.check, cfg.new, policies, clock.left) | {"seconds": time.perf_counter() - t}
        print(f"[{name}] check " + ", ".join(f"{p} {c.get('digest', 'skipped')}" for p, c in done["policies"].items()),
              flush=True)
        if any("skipped" in c for c in done["policies"].values()):
            rep["check_cut"] = store.stamp(done)  # not "check": a resumed run does it again
            store.report.setdefault("cut", []).append({"what": f"{name} check", "why": "the part's deadline"})
        else:
            rep["check"] = store.stamp(done)
        store.save()
    bench_points(name, cfg, store, clock, rep, lanes, sets, model)
    del model, lanes, eager
    if cfg.device == "cuda":
        torch.cuda.empty_cache()


def bench_points(name, cfg: TableConfig, store: Store, clock: Clock, rep: dict, lanes, sets, model) -> None:
    bench, last = rep.setdefault("bench", {}), 0.0
    rep["not_reached"] = []
    if "check" not in rep:  # cut by the deadline: the points would find no time either
        rep["not_reached"] = [{"B": b, "why": "the check did not finish"} for b in cfg.batch_sizes]
        return
    for b in cfg.batch_sizes:
        if f"B{b}" in bench and not any("skipped" in p for p in bench[f"B{b}"]["policies"].values()):
            continue  # finished by the run resumed
        if clock.left() < last:
            rep["not_reached"].append({"B": b, "why": f"{clock.left():.0f} s left, the last point took {last:.0f} s"})
            continue
        t = time.perf_counter()
        row = bench_point(lanes, sets.timed[:b], cfg.new, specs(rep["tau"]["tau"], cfg.window, cfg.group),
                          cfg.warmup, cfg.repeats, clock.left)
        last = time.perf_counter() - t
        row |= {"seconds": last, "floor_ms": floor_ms(model, b, cfg.prompt_len[1] + cfg.new // 2, cfg.bandwidth)}
        bench[f"B{b}"] = store.stamp(row)
        fast = row["policies"]["fast"].get("decode_ms_per_step", {}).get("median")
        print(f"[{name}] B={b} ({last:.1f} s): fast {fast} ms/step; " + ", ".join(
            f"{p} {r['increase']:+.1%}" for p, r in row["policies"].items() if "increase" in r), flush=True)
        store.save()
