"""The batch-invariant kernels (C++, `csrc/`, built and loaded by `extension.py`) and which linear path runs.

Every reduction here has an order that is a function of the row alone: not of
the number of rows, the row's place among them, the torch thread count, or the
call the row arrives in. The build is loud: a machine that cannot build or run
these kernels gets an error naming what is missing, never a silent fallback to
library kernels that would break the determinism contract. The orders are stated once, in
`csrc/contract.h`.

The linear runs on the fastest path the CPU has that passed its load-time proof: for the bf16
contract AMX tiles, AVX512-BF16 dot products, AVX-512 or AVX2 FMAs, all in the same order and so to
the same bits; for the int8 contract (quantized matrices) AMX-INT8, AVX-512 VNNI or AVX2.
`MARGINGATE_FORCE_ISA=amx|avx512bf16|avx512|avx2` and `MARGINGATE_FORCE_INT8=int8-amx|...` force one
for audits, and a path the CPU cannot run is an error. Its weights are `packing.PackedWeight`s.
"""
from __future__ import annotations

import functools
import os

import torch

from ..errors import KernelBuildError
from .extension import build_dir, load
from .kv_format import LayerKV
from .packing import PackedWeight
from .quant_pack import QuantWeight

# The linear's paths by family, fastest first: the bf16 contract's (csrc/contract.h, 1) and the int8
# contract's (5). csrc/linear_paths.cpp holds the one table; this is its one mirror, for what must name the
# paths before the kernels are built (tests check that the two agree).
PATHS = {"bf16": ("amx", "avx512bf16", "avx512", "avx2"), "int8": ("int8-amx", "int8-avx512vnni", "int8-avx2")}
FORCE = {"bf16": "MARGINGATE_FORCE_ISA", "int8": "MARGINGATE_FORCE_INT8"}  # the audits' switch of each family
LABEL = {"bf16": "linear", "int8": "int8 linear"}  # as messages name a family's paths


class IsaError(KernelBuildError):
    """MARGINGATE_FORCE_ISA or MARGINGATE_FORCE_INT8 names a path this CPU cannot run, or no path at all."""


@functools.cache
def ops():
    """The compiled module (extension.load), with the linear paths the environment forces."""
    mod = load()
    for family, variable in FORCE.items():
        forced = os.environ.get(variable, "")
        if forced:  # `MARGINGATE_FORCE_ISA=avx2 margingate check ...`: audit that every path gives the same bits
            use_path(forced, mod, family)
    return mod


def family_of(name: str) -> str | None:
    return next((family for family, names in PATHS.items() if name in names), None)


def use_path(name: str, mod=None, family: str | None = None) -> None:
    """Run `name`'s family (or `family`, which must hold it) on that path from now on; IsaError naming why
    if it cannot: no such path, this CPU lacks it, the compiler could not build it, or its proof failed."""
    mod = mod or ops()
    family = family or family_of(name) or "bf16"
    status = {p["path"]: p for p in proofs(family, mod)}.get(name)
    if status is None or status["status"] != "passed":
        why = ("does not exist" if status is None else
               "cannot run on this CPU" if status["status"] == "cpu lacks it" else
               "is not built: the compiler lacks its target" if status["status"] == "not built" else
               f"was refused at load: its proof failed ({status['detail']})")
        raise IsaError(f"{FORCE[family]}={name}: the {LABEL[family]} path {name!r} {why}; this CPU runs "
                       f"{', '.join(usable_paths(family, mod)) or 'none'} (paths: {', '.join(PATHS[family])})")
    mod.set_path(name)


def proofs(family: str, mod=None) -> list[dict]:
    """Every path of `family` ("bf16" or "int8"), fastest first: {path, status, detail}, status one of
    "passed", "failed" (detail: the first output that differed from the family's reference; the path is
    refused), "not built", "cpu lacks it". The paths the CPU runs are proven on first asking (a few ms each)."""
    return [{"path": p, "status": st, "detail": d} for f, p, st, d in (mod or ops()).path_proofs() if f == family]


def refused_paths(family: str) -> dict[str, str]:
    """{path: why} for the paths of `family` this CPU runs whose load-time proof failed (reports, /health)."""
    return {p["path"]: p["detail"] for p in proofs(family) if p["status"] == "failed"}


def path_in_use(family: str) -> str:
    """The path `family` runs: for bf16 x (fp32 activations take the best FMA path: avx512 or avx2), or
    the int8 contract's; a RuntimeError naming every path's status where none passed its proof."""
    return ops().path_in_use(family)


def usable_paths(family: str, mod=None) -> list[str]:
    """The paths of `family` that are built, that this CPU runs and that passed their proof, fastest first."""
    return [p["path"] for p in proofs(family, mod) if p["status"] == "passed"]


def linear(x: torch.Tensor, w: PackedWeight | QuantWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + b for x [M, K] (bf16 or fp32), W packed or kept quantized; result in x's dtype. Packed, or
    quantized under "exact": fp32 accumulation in the bf16 order (contract.h, 1; with fp32 x the products
    use the bf16 weights upcast, exactly). Quantized under "int8": x's rows quantized to int8 by the row
    alone, exact integer sums, one float epilogue (contract.h, 5)."""
    return ops().linear(x.contiguous(), w.data, w.n, b, x.dtype == torch.float32)


def linear_reference(x: torch.Tensor, w: PackedWeight | QuantWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` one scalar FMA at a time, as csrc/contract.h states the order: what every path equals."""
    return ops().linear_reference(x.contiguous(), w.data, w.n, b, x.dtype == torch.float32)


def quantize_rows_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x's rows [M, K] as the int8 contract quantizes them (contract.h, 5a), K padded with zeros to a
    multiple of `block`: q [M, Kp] int8, scale [M, Kp / block] fp32, sum16 [M, Kp / 16] int32."""
    q, scale, sum16 = ops().quantize_rows_int8(x.contiguous(), block)
    return q, scale, sum16


def expert_set(experts: list[tuple[PackedWeight | QuantWeight, PackedWeight | QuantWeight]], top_k: int,
               normalize: bool, gpt_oss=None):
    """A mixture-of-experts layer's (gate_up, down) per expert for `moe_block` and the compiled stack, parsed
    once (csrc/moe.cpp); `[]` (top_k 0): a dense layer's empty set. `gpt_oss`: (the experts' (gate_up bias,
    down bias) pairs, the router's bias, (alpha, limit)) for gpt-oss's biases, route and clamped SwiGLU."""
    n_gate_up, n_down = (experts[0][0].n, experts[0][1].n) if experts else (0, 0)
    out = ops().ExpertSet([g.data for g, _ in experts], [d.data for _, d in experts], n_gate_up, n_down, top_k,
                          normalize)
    if gpt_oss is not None:
        biases, router_bias, (alpha, limit) = gpt_oss
        out.set_gpt_oss([g for g, _ in biases], [d for _, d in biases], router_bias, alpha, limit)
    return out


def moe_route(logits: torch.Tensor, k: int, normalize: bool,
              topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [N, E] -> (experts [N, k] int64, weights [N, k] fp32), models/moe.py's steps 2-4
    (`topk_first`: gpt-oss's, the top-k of the logits and then the softmax of those k)."""
    experts, weights = ops().moe_route(logits.float().contiguous(), k, normalize, topk_first)
    return experts, weights


def moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """An MoE block's step 5 for rows x [N, hidden] (`chosen` [N, k] expert ids, `weights` [N, k] in x's dtype,
    `experts` an `expert_set`): models/moe.py's loop over experts in one call. Under the int8 contract all
    chosen experts' panels of a matrix run in one parallel region."""
    return ops().moe_experts(x.contiguous(), chosen.contiguous(), weights.contiguous(), experts)


def moe_block(x: torch.Tensor, router: PackedWeight | QuantWeight, experts) -> torch.Tensor:
    """An MoE block for rows x [N, hidden]: the router's logits through the linear, the route, the experts."""
    return ops().moe_block(x.contiguous(), router.data, experts)


def attention(q: torch.Tensor, kv: LayerKV, tables: torch.Tensor, table_of: torch.Tensor, lengths: torch.Tensor,
              scale: float, aligns: torch.Tensor | None = None, window: int = 0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Row r of q [N, H, D] attends over keys [0, lengths[r]) of its request's cache: block table
    tables[table_of[r]] ([T, W] int64) of the layer's paged cache `kv` (with `window` > 0, only the last
    `window` keys), its key chunks laid from its first key (exact; aligns None or 0) or aligned to a
    padded length aligns[r] (`fast`). `sinks` [H]: gpt-oss's per-head logits in the softmax's denominator."""
    aligns = torch.zeros_like(lengths) if aligns is None else aligns
    sinks = _NO_SINKS if sinks is None else sinks
    return ops().attention(q.contiguous(), *LayerKV(*kv), tables, table_of, lengths, aligns, scale, window, sinks)


_NO_SINKS = torch.empty(0)


def kv_write(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, table_of: torch.Tensor,
             positions: torch.Tensor) -> None:
    """Rows' K and V [N, kv_heads, D] (bf16) into their positions of the layer's paged cache (a quantized cache
    rotates and quantizes each head by itself, csrc/contract.h 6)."""
    ops().kv_write(*LayerKV(*kv), k.contiguous(), v.contiguous(), tables, table_of, positions)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = 0) -> torch.Tensor:
    """Per-row RMSNorm. `mode` (LayerSpec.norm_mode): 0 the normed row rounded, then times w; 1 (Gemma, or True):
    the weight stored is w, the scale 1 + w, applied in fp32; 2 (gpt-oss): times w in fp32. Rounded once after."""
    return ops().rmsnorm(x.contiguous(), weight, eps, int(mode))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return ops().silu_mul(gate_up.contiguous())


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return ops().gelu_tanh_mul(gate_up.contiguous())


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    limit), each op rounded as transformers' (csrc/rowwise.cpp)."""
    return ops().swiglu_clamped(gate_up.contiguous(), alpha, limit)


def logsumexp_rows(logits: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(row))) of each fp32 row [R, V], in csrc/logits.cpp's fixed order (one thread per row,
    no libm): the log-softmax of a row is then `row - lse`, the same bits wherever the row came from."""
    return ops().logsumexp_rows(logits.float().contiguous())


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU (erf form) of every element of an fp32 or bf16 tensor, in its dtype (kernels/encoder.gelu)."""
    return ops().gelu_erf(x.contiguous())


def exp_shifted(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """exp(row - shift[row]) of fp32 rows [R, V] with the contract's exp (no libm, no ISA dispatch)."""
    return ops().exp_shifted(logits.float().contiguous(), shift.float().contiguous())


def sum_exp_rows(logits: torch.Tensor) -> torch.Tensor:
    """sum(exp(row - max(row))) of each fp32 row [R, V], fp64, in logsumexp_rows's fixed order."""
    return ops().sum_exp_rows(logits.float().contiguous())


def argmax_rows(scores: torch.Tensor) -> list[int]:
    """Each row's argmax [R, V] -> R ids, as torch.argmax gives it (the first maximum; a NaN wins over
    any number). torch's own takes about 1 ns per element: a few % of a small model's B = 16 step."""
    return ops().argmax_rows(scores.float().contiguous())


def add_gumbel_(rows: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """rows[r] += -log(-log(u)) in place, u keyed by (seed, first_position + r, token id): Philox4x32-10
    (csrc/logits.cpp, our own generator) and our own log, so seeded sampling's noise is the same bits on
    every x86 CPU and every torch version. `rows`: contiguous fp32 [R, V]."""
    ops().add_gumbel_(rows, seed, first_position)
    return rows


def philox4x32(counter: list[int], key: list[int]) -> list[int]:
    """One Philox4x32-10 block (the generator's known-answer tests)."""
    out = ops().philox4x32(torch.tensor(counter, dtype=torch.long), torch.tensor(key, dtype=torch.long))
    return [int(x) for x in out]


if __name__ == "__main__":  # `python -m margingate.kernels.invariant`: build now (make venv does)
    ops()
    print(f"margingate invariant kernels ready in {build_dir()}")
