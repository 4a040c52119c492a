"""Batch-invariant Triton kernels for CUDA (issue 26): linear, attention over the slot KV cache,
RMSNorm, SiLU / GELU-tanh x up and log-softmax, each with one reduction order per row whatever
the batch (matmul_kernel.py, attention_kernel.py and rowwise.py say which).

They run compiled on a CUDA device, or on CPU under Triton's interpreter (`TRITON_INTERPRET=1`
before the kernels are first used: the tests' mode, slow). A machine that can do neither gets
`TritonUnavailableError` naming what is missing; nothing here ever falls back to torch ops.

dtypes: bf16 or fp32 tensors in, the input's dtype out, fp32 arithmetic inside. On CUDA, bf16
tensors go to the kernels as they are. The interpreter mishandles bf16 (its `tl.dot` multiplies
the raw bits, its fp32 -> bf16 cast truncates), so there the wrappers pass fp32 copies of bf16
tensors (exact) and round the fp32 results to bf16 with torch (nearest even, as the GPU's
store does): the bits are those of a bf16 load with fp32 arithmetic.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace

import torch

from ..invariant import KernelBuildError

INTERPRET_ENV = "TRITON_INTERPRET"
INTERPRETER_PROGRAMS = 4  # the persistent linear's program count under the interpreter (no SMs to fill)
_DTYPES = (torch.bfloat16, torch.float32)
# Every launch: no mul + add contraction, so the code's expressions are what runs (as csrc's
# -ffp-contract=off), and the bits do not follow Triton's default, which flips in 3.10.
_LAUNCH = {"enable_fp_fusion": False}


class TritonUnavailableError(KernelBuildError):
    """The Triton kernels cannot run here: triton missing, or neither a CUDA device nor the interpreter."""


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return ("margingate's Triton kernels need triton: `pip install triton` (CUDA builds of torch bring "
                "their own; the tests pin triton==3.7.1, in margingate[test])")
    if os.environ.get(INTERPRET_ENV) != "1" and not torch.cuda.is_available():
        return (f"margingate's Triton kernels need a CUDA device, and torch sees none ({INTERPRET_ENV} is unset); "
                f"set {INTERPRET_ENV}=1 before the first use to run them on CPU under Triton's interpreter (slow)")
    return None


def available() -> bool:
    return unavailable_reason() is None


def require() -> None:
    """Raise TritonUnavailableError, naming what is missing, unless the kernels can run here."""
    reason = unavailable_reason()
    if reason:
        raise TritonUnavailableError(reason)


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernel modules, imported on first use: triton.jit decides compiled or interpreted then."""
    require()
    from triton.runtime.interpreter import InterpretedFunction

    # not `matmul` / `attention`: importing a submodule sets the package attribute of its name
    from . import attention_kernel, matmul_kernel, rowwise

    return SimpleNamespace(matmul=matmul_kernel, attention=attention_kernel, rowwise=rowwise,
                           interpreted=isinstance(matmul_kernel.linear_kernel, InterpretedFunction))


def interpreting() -> bool:
    """True when the kernels run (or, not loaded yet, would run) under Triton's CPU interpreter; the mode
    is fixed when they are first loaded. False where they cannot run at all (see `unavailable_reason`)."""
    if _kernels.cache_info().currsize:
        return _kernels().interpreted
    return available() and os.environ.get(INTERPRET_ENV) == "1"


def _operand(t: torch.Tensor, name: str, strided: bool = False) -> torch.Tensor:
    """A kernel's view of t: contiguous (unless `strided`: the kernel takes its strides), 16-byte aligned on
    CUDA (another alignment would compile another binary, possibly with another reduction layout); an exact
    fp32 copy under the interpreter."""
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: the Triton kernels take bf16 or fp32 tensors, got {t.dtype}")
    if _kernels().interpreted:
        return t.float().contiguous()
    if t.device.type != "cuda":
        raise ValueError(f"{name}: compiled Triton kernels take CUDA tensors, got one on {t.device} "
                         f"(set {INTERPRET_ENV}=1 to run CPU tensors under the interpreter)")
    t = t if strided else t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _output(shape, like: torch.Tensor) -> torch.Tensor:
    """Where a kernel writes a result in like's dtype: fp32 under the interpreter (see `_finish`)."""
    dtype = torch.float32 if _kernels().interpreted else like.dtype
    return torch.empty(shape, dtype=dtype, device=like.device)


def _finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The interpreter's fp32 result rounded to dtype by torch (nearest even); on CUDA, out as is."""
    return out if out.dtype == dtype else out.to(dtype)


@functools.cache
def _num_programs(device_index: int) -> int:
    """The persistent linear's program count: one per SM (the count is not in the bits)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ bias [N]) -> [..., N] in x's dtype, fp32 accumulation over K in one order
    for every M (matmul_kernel.TILE). bf16 x bf16 runs on tensor cores; any fp32 operand makes both fp32."""
    k = _kernels()
    if x.shape[-1] != w.shape[1] or w.dim() != 2 or (bias is not None and bias.shape != (w.shape[0],)):
        raise ValueError(f"linear: x [..., K], w [N, K], bias [N]; got {tuple(x.shape)}, {tuple(w.shape)}, "
                         f"{None if bias is None else tuple(bias.shape)}")
    lead, (n, kdim) = x.shape[:-1], w.shape
    x2 = _operand(x.reshape(-1, kdim), "x")
    w2 = _operand(w, "w", strided=True)  # a model constant: its strides never vary between calls
    b = _operand(bias, "bias") if bias is not None else None
    m = x2.shape[0]
    out = _output((m, n), x)
    if m == 0:
        return _finish(out, x.dtype).reshape(*lead, n)
    tile = k.matmul.TILE
    tiles = _cdiv(m, tile["BLOCK_M"]) * _cdiv(n, tile["BLOCK_N"])
    programs = INTERPRETER_PROGRAMS if k.interpreted else _num_programs(x2.device.index or 0)
    dot_fp32 = x2.dtype == torch.float32 or w2.dtype == torch.float32
    k.matmul.linear_kernel[(min(tiles, programs),)](
        x2, w2, b if b is not None else w2, out, m, n, kdim, x2.stride(0), x2.stride(1), w2.stride(1), w2.stride(0),
        out.stride(0), out.stride(1), HAS_BIAS=b is not None, DOT_FP32=dot_fp32, NUM_PROGRAMS=programs,
        num_warps=k.matmul.NUM_WARPS, num_stages=k.matmul.NUM_STAGES["fp32" if dot_fp32 else "bf16"], **tile, **_LAUNCH)
    return _finish(out, x.dtype).reshape(*lead, n)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N]: `linear` with w = b.T (a strided view, no copy on CUDA)."""
    return linear(a, b.t())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention(q: torch.Tensor, kv: tuple, tables: torch.Tensor, table_of: torch.Tensor, lengths: torch.Tensor,
              scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Row r of q [N, H, D] attends over keys [0, lengths[r]) of its block table tables[table_of[r]] in one
    layer's paged cache `kv` (K, V [blocks, Hkv, B, D], scales: KVPool.layer; `window` > 0: only the last
    `window` keys; `sinks` [H]: gpt-oss's attention sinks, merged after the last chunk). GQA: query head h
    reads KV head h // (H / Hkv). Returns [N, H, D] in q's dtype. The caller
    keeps the tables and lengths in range (checked under the interpreter; a CUDA check would cost a sync per
    layer)."""
    k = _kernels()
    k_cache, v_cache, k_scale = kv[:3]
    n, h, d = q.shape
    if k_scale.numel():
        raise ValueError("attention: the Triton kernel reads a bf16 KV cache; an int8 or int4 cache runs on the "
                         "compiled CPU kernels (--kv-cache-dtype int8 or int4 with --kernels compiled)")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != d or h % k_cache.shape[1]:
        raise ValueError(f"attention: q [N, H, D], caches [blocks, Hkv, B, D] with Hkv dividing H; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if table_of.shape != (n,) or lengths.shape != (n,):
        raise ValueError(f"attention: one table and one length per row; got table_of {tuple(table_of.shape)}, "
                         f"lengths {tuple(lengths.shape)}")
    if k.interpreted:
        _check_rows(tables, table_of, lengths, k_cache.shape[0], k_cache.shape[2])
    qc, kc, vc = _operand(q, "q"), _operand(k_cache, "k_cache"), _operand(v_cache, "v_cache")
    tables = tables.contiguous()
    out = _output((n, h, d), q)
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"attention: one sink per query head ({h}); got {tuple(sinks.shape)}")
    sk = _operand(sinks, "sinks") if sinks is not None else qc
    if n:
        k.attention.attention_kernel[(n, h)](
            qc, kc, vc, out, tables, table_of.contiguous(), lengths.contiguous(), sk, float(scale), int(window), d,
            k_cache.shape[2], qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), out.stride(0),
            out.stride(1), tables.stride(0),
            GROUP=h // k_cache.shape[1], BLOCK_D=max(16, 1 << (d - 1).bit_length()), CHUNK=k.attention.CHUNK,
            HAS_SINKS=sinks is not None, num_warps=k.attention.NUM_WARPS, **_LAUNCH)
    return _finish(out, q.dtype)


def _check_rows(tables: torch.Tensor, table_of: torch.Tensor, lengths: torch.Tensor, num_blocks: int,
                block: int) -> None:
    if table_of.numel() and (int(table_of.min()) < 0 or int(table_of.max()) >= tables.shape[0]):
        raise ValueError(f"attention: table_of must be in [0, {tables.shape[0]})")
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > tables.shape[1] * block):
        raise ValueError(f"attention: lengths must be in [1, {tables.shape[1] * block}]")
    for r in range(table_of.numel()):
        used = tables[int(table_of[r]), :-(-int(lengths[r]) // block)]
        if int(used.min()) < 0 or int(used.max()) >= num_blocks:
            raise ValueError(f"attention: row {r}'s block table leaves the pool's {num_blocks} blocks")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int = 0) -> torch.Tensor:
    """Per-row RMSNorm over the last dim, as library.rmsnorm (Hugging Face): fp32 statistics; Llama (mode 0):
    weight * h cast to x's dtype; Gemma (1): h * (1 + weight) in fp32; gpt-oss (2): weight * h in fp32. Result in
    x's dtype."""
    k = _kernels()
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rmsnorm: weight [{d}] for rows of {d}; got {tuple(weight.shape)}")
    x2 = _operand(x.reshape(-1, d), "x")
    out = _output(x2.shape, x)
    if x2.shape[0]:
        k.rowwise.rmsnorm_kernel[(x2.shape[0],)](
            x2, _operand(weight, "weight"), out, d, float(eps), UNIT_OFFSET=mode == 1,
            ROUND_H=x.dtype == torch.bfloat16 and mode != 2, BLOCK=k.rowwise.BLOCK, num_warps=k.rowwise.NUM_WARPS,
            **_LAUNCH)
    return _finish(out, x.dtype).reshape(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate | up) -> [..., I], as library.silu_mul."""
    return _act_mul(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up [..., 2I] (gate | up) -> [..., I], as library.gelu_tanh_mul."""
    return _act_mul(gate_up, gelu=True)


def _act_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    k = _kernels()
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: an even last dim (gate | up); got {tuple(gate_up.shape)}")
    inter = gate_up.shape[-1] // 2
    gu = _operand(gate_up.reshape(-1, 2 * inter), "gate_up")
    out = _output((gu.shape[0], inter), gate_up)
    if gu.shape[0] and inter:
        block = k.rowwise.BLOCK
        k.rowwise.act_mul_kernel[(gu.shape[0], _cdiv(inter, block))](
            gu, out, inter, GELU=gelu, ROUND_ACT=gate_up.dtype == torch.bfloat16, BLOCK=block,
            num_warps=k.rowwise.NUM_WARPS, **_LAUNCH)
    return _finish(out, gate_up.dtype).reshape(*gate_up.shape[:-1], inter)


def swiglu_clamped(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' activation for gate_up [..., 2I] (gate | up) -> [..., I], as library.swiglu_clamped."""
    k = _kernels()
    inter = gate_up.shape[-1] // 2
    gu = _operand(gate_up.reshape(-1, 2 * inter), "gate_up")
    out = _output((gu.shape[0], inter), gate_up)
    if gu.shape[0] and inter:
        k.rowwise.swiglu_clamped_kernel[(gu.shape[0], _cdiv(inter, k.rowwise.BLOCK))](
            gu, out, inter, float(alpha), float(limit), ROUND=gate_up.dtype == torch.bfloat16, BLOCK=k.rowwise.BLOCK,
            num_warps=k.rowwise.NUM_WARPS, **_LAUNCH)
    return _finish(out, gate_up.dtype).reshape(*gate_up.shape[:-1], inter)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of fp32 logits [R, V]: row - logsumexp(row), fp32, in one order per
    row (max, per-lane sums of exp, their one sum)."""
    k = _kernels()
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"log_softmax: fp32 logits [R, V]; got {logits.dtype} {tuple(logits.shape)}")
    x = _operand(logits, "logits")
    out = torch.empty_like(x)
    if x.shape[0] and x.shape[1]:
        k.rowwise.log_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=k.rowwise.BLOCK,
                                                    num_warps=k.rowwise.NUM_WARPS, **_LAUNCH)
    return out
