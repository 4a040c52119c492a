"""One decode step against the memory-read floor, and where its time goes.

A B = 1 decode step is memory-bound: it must read every linear weight and the head once, as stored (a
quantized model's blocks), and the request's K/V so far. `decode_roofline` times B = 1 steps (no profiler),
divides those bytes by the read bandwidth that `roofline.measure` found (a sum over a 2 GiB buffer at the
engine's threads) and reports the fraction of that floor the step reaches. `profile` splits a step by kind
of work: cProfile attributes every built-in call, and inside the one-call compiled stack (`decoder_stack`) the
kernels' own phase timers split its time. cProfile adds a little to each Python call, so `python, rest` is an
upper bound; the kinds add up to the profiled step, a little longer than the unprofiled one.
"""
from __future__ import annotations

import cProfile
import pstats
import statistics
import time

STEPS = 20          # timed steps (half without, half under the profiler)
CONTEXT = 32        # tokens decoded before timing starts
LINEAR, ATTENTION, ROWWISE, LOGITS, REST = "linear", "attention", "norms, rotary, K/V write", "logits, sampling", \
    "python, rest"
KINDS = (LINEAR, ATTENTION, ROWWISE, LOGITS, REST)
STACK = "margingate_invariant.decoder_stack"
STACK_PHASES = {"gemm": LINEAR, "attention": ATTENTION, "norms": ROWWISE, "rope, kv write": ROWWISE,
                "residual, silu": ROWWISE}
CALLS = {  # substring of a profiled call's name -> kind (first match wins); linear calls: see `_kind`
    "margingate_invariant.attention": ATTENTION, "scaled_dot_product_attention": ATTENTION,
    "kv_write": ROWWISE, "kv_cache.py": ROWWISE, "rotary": ROWWISE, "rmsnorm": ROWWISE, "silu": ROWWISE,
    "gelu": ROWWISE, "argmax": LOGITS, "logsumexp": LOGITS, "exp_shifted": LOGITS, "sum_exp": LOGITS,
    "gumbel": LOGITS, "philox": LOGITS,
}
LINEAR_CALLS = ("margingate_invariant.linear", "_nn.linear")


def _kind(name: str, fused: bool) -> str:
    if any(s in name for s in LINEAR_CALLS):  # with the stack fused, the one linear outside it is the LM head
        return LOGITS if fused else LINEAR
    return next((k for s, k in CALLS.items() if s in name), REST)


def profile(llm, policy: str = "fast", batch_size: int = 1, steps: int = STEPS) -> dict:
    """`batch_size` requests (the built-in prompts) decode CONTEXT tokens, then `steps` // 2 steps are timed
    and as many profiled: the median step in ms, and the profiled ms per step by kind."""
    from ..data.prompts import builtin_prompts
    from ..engine import Request  # torch: loaded by the model already, not by the commands' --help
    from ..kernels import invariant

    engine, prompts = llm.engine, builtin_prompts()
    seqs = [engine.add_request(Request(llm.tokenizer.encode_prompt(prompts[i % len(prompts)]), CONTEXT + steps + 8,
                                       llm.policy(policy), ignore_eos=True, request_id=f"profile-{policy}-{i}"))
            for i in range(batch_size)]
    try:
        while min(len(s.output_ids) for s in seqs) < CONTEXT:
            engine.step()
        times = []
        for _ in range(steps // 2):
            t = time.perf_counter()
            engine.step()
            times.append(1000 * (time.perf_counter() - t))
        contexts = [s.num_tokens for s in seqs]
        prof = cProfile.Profile()
        invariant.ops().stack_profile(True)
        prof.enable()
        for _ in range(steps // 2):
            engine.step()
        prof.disable()
        phases = invariant.ops().stack_profile(False)
    finally:
        for s in seqs:
            engine.abort(s.request_id)
        engine.step()
    return {"step_ms": statistics.median(times), "contexts": contexts,
            "ms_by_kind": by_kind(pstats.Stats(prof).stats, phases, steps // 2)}


def by_kind(stats: dict, phases: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """cProfile's stats ((file, line, name) -> (calls, ncalls, tottime, cumtime, callers)) and the stack's phase
    timers, as ms per step by kind (every kind, in KINDS' order)."""
    fused = any(STACK in f"{file}:{name}" for file, _, name in stats)
    out = dict.fromkeys(KINDS, 0.0)
    for (file, _, name), (_, _, tottime, _, _) in stats.items():
        if STACK in f"{file}:{name}":  # split by the stack's own timers; what they miss is the rest
            timed = sum(ms for _, ms in phases) / 1000
            pieces = [(STACK_PHASES[p], ms / 1000) for p, ms in phases] + [(REST, tottime - timed)]
        else:
            pieces = [(_kind(f"{file}:{name}", fused), tottime)]
        for kind, seconds in pieces:
            out[kind] += 1000 * seconds / steps
    return out


def decode_roofline(llm, read_gb_s: float, steps: int = STEPS) -> dict:
    """B = 1 decode against the read floor: bytes a step must read (weights as stored, the request's K/V),
    the floor at `read_gb_s` (GB/s, 1e9 bytes), the step measured, the fraction, and the step's profile."""
    from ..analysis.roofline import StepCost
    from ..models.weights import streamed_bytes

    weights = streamed_bytes(llm.model.own_weights)
    run = profile(llm, "fast", 1, steps)
    kv = StepCost.of(llm.config, weights).kv_bytes_per_position * run["contexts"][0]
    floor_ms = 1000 * (weights + kv) / (read_gb_s * 1e9)
    return {"weight_bytes": weights, "kv_bytes": kv, "context": run["contexts"][0], "read_gb_s": read_gb_s,
            "floor_ms": floor_ms, "step_ms": run["step_ms"], "fraction": floor_ms / run["step_ms"],
            "ms_by_kind": run["ms_by_kind"]}


def format_decode_roofline(r: dict, title: str = "### B = 1 decode against the read floor") -> str:
    kinds = " | ".join(f"{r['ms_by_kind'][k]:.2f}" for k in KINDS)
    return "\n".join([
        title, "", f"A step reads {r['weight_bytes'] / 2**20:.0f} MiB of weights (as stored) and "
        f"{r['kv_bytes'] / 2**20:.2f} MiB of K/V ({r['context']} positions); at the measured "
        f"{r['read_gb_s']:.1f} GB/s that takes {r['floor_ms']:.2f} ms. Profile: ms per step by kind (cProfile and "
        "the compiled stack's phase timers; `python, rest` is an upper bound).", "",
        "| bytes / step | floor ms | step ms | fraction of floor | " + " | ".join(KINDS) + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(KINDS),
        f"| {(r['weight_bytes'] + r['kv_bytes']) / 2**20:.0f} MiB | {r['floor_ms']:.2f} | {r['step_ms']:.2f} | "
        f"**{100 * r['fraction']:.0f} %** | {kinds} |"])
