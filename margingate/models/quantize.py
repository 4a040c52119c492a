"""Quantize at load: a bf16 source's matrices as GGUF blocks (Q8_0, Q4_K), decoded as a GGUF file's are.

`LLM(folder, quantize="q4_k")` (`--quantize q4_k`) quantizes each matrix (the linears, lm_head,
embed_tokens) row by row into the blocks ggml-common.h defines: Q8_0 with gguf-py's quantizer, Q4_K
with ours (q4_k.py); both are llama.cpp's reference quantizers, bit for bit. A matrix whose rows do
not fill whole blocks falls back: to Q8_0 under q4_k (rows of a multiple of 32, not of 256 weights),
else it stays bf16.

The blocks go through the decoder a GGUF file's go through (`gguf_quant.quant_codes`), so
`weights.build` keeps them quantized as it keeps a GGUF's, and `margingate export --quantize`
(gguf_export.py) writes the same blocks into a GGUF: the folder quantized at load and its exported
file give the same tokens and logprobs, bitwise. Quantization is per row, so the export's Q/K row
permutation permutes the blocks and changes none of them.
"""
from __future__ import annotations

import numpy as np
import torch

from .config import ModelConfig
from .gguf_quant import quant_codes
from .loader import Checkpoint, gguf_parts
from .q4_k import quantize_q4_k
from .weights import BlockSource, matrix_names

# under each --quantize, the block types tried in turn: the first whose block divides a row is used
FALLBACK = {"q8_0": ("Q8_0",), "q4_k": ("Q4_K", "Q8_0")}


class QuantizeError(ValueError):
    """A source or a matrix that cannot be quantized at load."""


def check_source(model: str, quantize: str | None) -> None:
    """--quantize quantizes a bf16 source; a GGUF is quantized already (its blocks stay as they are)."""
    if quantize is not None and gguf_parts(model) is not None:
        raise QuantizeError(f"--quantize {quantize}: {model} is a GGUF model, quantized already (run it as it is: "
                            "--weights auto keeps its blocks); --quantize quantizes a bf16 source, a Hugging Face "
                            "folder (config.json and *.safetensors)")


def block_type(k: int, quantize: str) -> str | None:
    """The GGUF type a matrix with rows of `k` weights is quantized to under `quantize`; None: it stays bf16."""
    import gguf

    sizes = {t: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0] for t in FALLBACK[quantize]}
    return next((t for t, size in sizes.items() if k % size == 0), None)


def quantize_rows(w: torch.Tensor, type_name: str, name: str) -> np.ndarray:
    """[n, k] weights -> [n, row bytes] uint8 blocks of GGUF type `type_name` ("Q8_0" or "Q4_K")."""
    import gguf

    x = w.float().numpy()  # bf16 -> fp32: exact
    if not np.isfinite(x).all():
        bad = np.argwhere(~np.isfinite(x))[0]
        raise QuantizeError(f"{name} holds a value that is not a finite number ({x[tuple(bad)]} at row {bad[0]}, "
                            f"column {bad[1]}): it cannot be quantized to {type_name}")
    if type_name == "Q4_K":
        blocks = quantize_q4_k(x)
    else:
        with np.errstate(over="ignore"):  # a scale past fp16's range: refused by name just below
            blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType[type_name])
    _check_scales(blocks, type_name, name, x)
    return blocks


def _check_scales(blocks: np.ndarray, type_name: str, name: str, x: np.ndarray) -> None:
    """Every block's fp16 scales (d; Q4_K's dmin too, the first bytes of both layouts) finite."""
    import gguf

    nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    scales = np.ascontiguousarray(blocks.reshape(-1, nbytes)[:, :4 if type_name == "Q4_K" else 2]).view(np.float16)
    if not np.isfinite(scales).all():
        raise QuantizeError(f"{name} holds weights up to {np.abs(x).max():.4g} in magnitude: too large for "
                            f"{type_name}'s fp16 block scales (at most 65504)")


class QuantizedAtLoad(BlockSource):
    """A bf16 matrix held as `type_name` blocks: quantized when the model is built (one matrix at a time,
    as a GGUF's are read), decoded by the GGUF decoder."""

    def __init__(self, tensor: torch.Tensor, type_name: str, name: str):
        self.tensor, self.type_name, self.name = tensor, type_name, name
        self.shape = tuple(tensor.shape)

    def run(self, start: int, stop: int):
        return quant_codes(quantize_rows(self.tensor[start:stop], self.type_name, self.name), self.type_name,
                           self.name)


def quantize_state(state: Checkpoint, config: ModelConfig, quantize: str, contract: str | None = "int8") -> Checkpoint:
    """`state` with each of the model's matrices a QuantizedAtLoad of its block type (the others as they
    are), kept under `contract` ("int8" or "exact"); None: the model dequantizes them at build
    (--weights bf16: the same values in bf16)."""
    out = Checkpoint(dict(state), state.source, contract=contract)
    for name in matrix_names(config):
        kind = block_type(state[name].shape[-1], quantize) if name in state else None  # missing: check names it
        if kind is not None:
            out[name] = QuantizedAtLoad(state[name], kind, name)
    return out
