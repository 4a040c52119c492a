"""The cost of one forward, by kind, measured side by side: a `fast` decode step of B rows
against verifier passes (the invariant kernels over many rows of a few requests).

The policies' end-to-end times mix many steps; this isolates the two forwards a verifying
policy trades against each other. Both are timed interleaved on the same engine and the
same cache state, so machine noise hits them alike.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from ..engine import Request

if TYPE_CHECKING:  # the facade loads the model stack: only when the command runs
    from ..llm import LLM

WARM_TOKENS = 64  # decode this far first, so the rows attend over realistic prefixes


def pass_profile(llm: LLM, prompt_ids: list[list[int]], repeats: int = 5) -> dict:
    """Median milliseconds of: one fast decode step over B = max_num_seqs rows; verifier
    passes of 64 rows (4 requests x 16 positions, and 1 x 64) and of 16 rows (16 x 1)."""
    from ..engine.policy import VerifyJob  # loads torch: only when the profile runs

    engine = llm.engine
    b = engine.config.max_num_seqs
    if len(prompt_ids) < b:
        raise ValueError(f"the pass profile needs {b} prompts, got {len(prompt_ids)}")
    seqs = [engine.add_request(Request(ids, WARM_TOKENS + 64, llm.policy("fast"), ignore_eos=True,
                                       request_id=f"profile-{i}")) for i, ids in enumerate(prompt_ids[:b])]
    try:
        while min(len(s.output_ids) for s in seqs) < WARM_TOKENS:
            engine.step()
        ends = [s.num_tokens - 2 for s in seqs]  # last positions with K/V: recomputing them rewrites the same
        verify = engine.verifier.recompute
        passes = {
            f"fast_step_B{b}": lambda: engine.runner.step([], seqs),
            "verify_64_rows_4x16": lambda: verify([VerifyJob(s, e - 15, e) for s, e in zip(seqs[:4], ends)]),
            "verify_64_rows_1x64": lambda: verify([VerifyJob(seqs[0], ends[0] - 63, ends[0])]),
            f"verify_{b}_rows_{b}x1": lambda: verify([VerifyJob(s, e, e) for s, e in zip(seqs, ends)]),
        }
        times: dict[str, list[float]] = {k: [] for k in passes}
        for _ in range(repeats + 1):  # the first round warms up
            for name, run in passes.items():
                t = time.perf_counter()
                run()
                times[name].append(1000 * (time.perf_counter() - t))
    finally:
        for s in seqs:
            engine.abort(s.request_id)
        engine.step()  # reports the aborted requests, frees their slots
    out = {k: round(statistics.median(v[1:]), 2) for k, v in times.items()}
    out["verify_64_rows_over_fast_step"] = round(out["verify_64_rows_4x16"] / out[f"fast_step_B{b}"], 3)
    out["batch_size"], out["context_tokens"] = b, round(statistics.mean(s.num_tokens for s in seqs))
    return out


def format_profile(p: dict) -> str:
    b = p["batch_size"]
    return (f"### One forward, by kind (median ms of {b} requests at ~{p['context_tokens']} tokens)\n\n"
            f"| forward | ms |\n|---|---|\n| `fast` decode step, B={b} (our GEMMs, padded-batch attention) | "
            f"{p[f'fast_step_B{b}']} |\n| verifier pass, 64 rows = 4 requests x 16 positions | "
            f"{p['verify_64_rows_4x16']} |\n| verifier pass, 64 rows = 1 request x 64 positions | "
            f"{p['verify_64_rows_1x64']} |\n| verifier pass, {b} rows = {b} requests x 1 position | "
            f"{p[f'verify_{b}_rows_{b}x1']} |\n\n64-row verifier pass / fast step: "
            f"**{p['verify_64_rows_over_fast_step']:.2f}x**")
