"""The floor under a decode step on this machine: how fast could any engine go?

A decode step of B rows must stream every weight once and each row's K/V prefix, and it
must do the step's FLOPs. `measure` times this machine's memory bandwidth (a read pass over
a 2 GiB buffer, far beyond the last-level cache, as STREAM does) and its GEMM rate (a large square
GEMM: bf16 where the CPU has bf16 dot products, else fp32, the fastest a CPU without them does;
torch's bf16 GEMM there takes minutes), at the thread count the bench runs at. `workload_floor` turns those into
the least time a whole bench workload could take: for each wave of B requests, one prefill
(compute: every prompt token through every weight) and max_new_tokens - 1 decode steps, each
max(bytes / bandwidth, FLOPs / GEMM rate). A policy's or a peer's *fraction of the floor* is
floor time / its time: 1.0 would be a perfect engine, by this model's optimism (caches, the
embedding gather, norms and sampling cost nothing).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from ..models.config import ModelConfig

BANDWIDTH_BYTES = 2 << 30   # 2 GiB: far beyond any last-level cache, about a 1B model's bf16 weights
GEMM_SIZE = 2048            # bf16 square GEMM: 17 GFLOP a call, compute-bound on CPUs
BF16 = 2                    # bytes


@dataclass(frozen=True)
class Machine:
    read_gb_s: float     # read bandwidth, GB/s (1e9 bytes)
    gemm_gflop_s: float  # GEMM rate, GFLOP/s
    threads: int
    gemm_dtype: str = "bf16"  # bf16, or fp32 on a CPU without bf16 dot products


def _best_of(fn, repeats: int) -> float:
    fn()  # warm: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _read_seconds(repeats: int) -> float:
    import torch  # measured when a bench runs; not on the import of the commands (--help)

    buf = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    return _best_of(buf.sum, repeats)  # the buffer is freed on return


def measure(threads: int, repeats: int = 5) -> Machine:
    """Best-of-`repeats` read bandwidth and bf16 GEMM rate at `threads` torch threads (STREAM
    reports the best run too: the floor is what the machine can do, not what it usually does)."""
    import torch  # as in _read_seconds

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        read = _read_seconds(repeats)
        dtype = torch.bfloat16 if _has_bf16_units() else torch.float32
        a = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
        b = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
        gemm = _best_of(lambda: torch.mm(a, b), repeats)
    finally:
        torch.set_num_threads(before)
    return Machine(read_gb_s=BANDWIDTH_BYTES / read / 1e9, gemm_gflop_s=2 * GEMM_SIZE ** 3 / gemm / 1e9,
                   threads=threads, gemm_dtype="bf16" if dtype == torch.bfloat16 else "fp32")


def _has_bf16_units() -> bool:
    from ..environment import cpu_info
    flags = (cpu_info("flags") or "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class StepCost:
    """What one forward must move and compute: weights once, plus per-row K/V and FLOPs."""
    weight_bytes: int        # every linear weight and the LM head, as stored
    linear_flops_per_row: int
    kv_bytes_per_position: int
    attention_flops_per_key: int  # per (query row, key position)

    @classmethod
    def of(cls, c: ModelConfig, weight_bytes: int | None = None) -> StepCost:
        """`weight_bytes`: what the model stores (a quantized model's); default its bf16 size."""
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        linear = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # + LM head (tied or not, it is read)
        return cls(weight_bytes=weight_bytes or BF16 * linear, linear_flops_per_row=2 * linear,
                   kv_bytes_per_position=c.num_layers * 2 * kv * BF16,
                   attention_flops_per_key=c.num_layers * 4 * q)

    def step_seconds(self, m: Machine, contexts: list[int]) -> float:
        """A decode step of len(contexts) rows, row i attending over contexts[i] positions."""
        keys = sum(contexts)
        bytes_ = self.weight_bytes + self.kv_bytes_per_position * keys
        flops = self.linear_flops_per_row * len(contexts) + self.attention_flops_per_key * keys
        return max(bytes_ / (m.read_gb_s * 1e9), flops / (m.gemm_gflop_s * 1e9))

    def prefill_seconds(self, m: Machine, prompt_lens: list[int]) -> float:
        """One prefill of these prompts (causal: position p attends over p + 1 keys)."""
        keys = sum(n * (n + 1) // 2 for n in prompt_lens)
        bytes_ = self.weight_bytes + self.kv_bytes_per_position * sum(prompt_lens)
        flops = self.linear_flops_per_row * sum(prompt_lens) + self.attention_flops_per_key * keys
        return max(bytes_ / (m.read_gb_s * 1e9), flops / (m.gemm_gflop_s * 1e9))


def workload_floor(cost: StepCost, m: Machine, prompt_lens: list[int], max_new_tokens: int,
                   batch_size: int) -> dict:
    """The least time for every prompt to produce max_new_tokens, B at a time (waves in order)."""
    total, decode = 0.0, []
    for i in range(0, len(prompt_lens), batch_size):
        wave = prompt_lens[i:i + batch_size]
        total += cost.prefill_seconds(m, wave)  # it yields each request's first token
        for t in range(1, max_new_tokens):
            step = cost.step_seconds(m, [n + t for n in wave])
            decode.append(step)
            total += step
    tokens = len(prompt_lens) * max_new_tokens
    return {"seconds": total, "tokens_per_s": tokens / total,
            "decode_step_ms_mean": 1000 * sum(decode) / len(decode) if decode else None}


def roofline(cost: StepCost, m: Machine, prompt_lens: list[int], max_new_tokens: int,
             batch_sizes: list[int]) -> dict:
    """The machine figures, the model's per-step costs and the floor at every batch size."""
    return {"machine": asdict(m), "weight_mb": cost.weight_bytes / 1e6,
            "gflop_per_row": cost.linear_flops_per_row / 1e9,
            "floor": {f"B{b}": workload_floor(cost, m, prompt_lens, max_new_tokens, b) for b in batch_sizes}}


def format_roofline(r: dict) -> str:
    m = r["machine"]
    lines = ["### The floor (roofline)", "",
             f"Measured here at {m['threads']} threads: read bandwidth **{m['read_gb_s']:.1f} GB/s** (sum over a "
             f"{BANDWIDTH_BYTES >> 30} GiB buffer, best of 5), {m.get('gemm_dtype', 'bf16')} GEMM "
             f"**{m['gemm_gflop_s']:.0f} GFLOP/s** "
             f"({GEMM_SIZE}^3 `torch.mm`, "
             f"best of 5). A decode step streams {r['weight_mb']:.0f} MB of weights plus each row's K/V and does "
             f"{r['gflop_per_row']:.2f} GFLOP per row; floor = max(bytes / bandwidth, FLOPs / GEMM rate) per step, "
             "plus one prefill per wave of B.", "",
             "| B | floor tok/s | floor ms / decode step |", "|---:|---:|---:|"]
    for key, f in r["floor"].items():  # no decode step when every request asks for one token (a prefill run)
        step = f["decode_step_ms_mean"]
        lines.append(f"| {key[1:]} | {f['tokens_per_s']:.1f} | {'-' if step is None else f'{step:.2f}'} |")
    return "\n".join(lines)
