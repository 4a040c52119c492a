"""How a model's weights are held, as plain data (no torch): `--weights` and `--quantize`."""
from __future__ import annotations

from ..errors import OptionError

#: auto: a GGUF's quantized matrices stay quantized under the integer-exact contract (int8 activations,
#: exact integer sums: csrc/contract.h, 5); exact: they stay quantized and give the bits of their bf16
#: values (contract.h, 1); bf16: every weight dequantized to bf16
WEIGHTS = ("auto", "exact", "bf16")
#: the contract a kept-quantized matrix runs under, by --weights (kernels/quant_pack.CONTRACTS)
QUANT_CONTRACT = {"auto": "int8", "exact": "exact"}
#: the GGUF block types a bf16 source (a Hugging Face folder) is quantized to at load (models/quantize.py)
QUANTIZE = ("q8_0", "q4_k")


def check_weights(weights: str, quantize: str | None) -> None:
    """`weights` one of WEIGHTS, `quantize` None or one of QUANTIZE; else an OptionError naming it."""
    if weights not in WEIGHTS:
        raise OptionError("weights", f"weights must be one of {', '.join(WEIGHTS)}; got {weights!r}")
    if quantize is not None and quantize not in QUANTIZE:
        raise OptionError("quantize", f"quantize must be one of {', '.join(QUANTIZE)} (GGUF block types) or "
                                      f"None; got {quantize!r}")
