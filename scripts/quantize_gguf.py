"""Quantize a BF16 GGUF with llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`).

The files issue 33 benchmarks on are made by a quantizer no one here wrote. Run with the llama.cpp
peer's environment (make llamacpp-venv):

    .venv-llamacpp/bin/python scripts/quantize_gguf.py IN.bf16.gguf OUT.gguf q4_k_m
"""
from __future__ import annotations

import sys
from pathlib import Path

FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q5_1": "LLAMA_FTYPE_MOSTLY_Q5_1",
          "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
          "mxfp4_moe": "LLAMA_FTYPE_MOSTLY_MXFP4_MOE",  # gpt-oss's: MXFP4 experts, Q8_0 elsewhere
          # issue 64: types that need no importance matrix (IQ1, IQ2 and IQ3_XXS do: scripts/quantize_iq_gguf.py)
          "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K", "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
          "q3_k_s": "LLAMA_FTYPE_MOSTLY_Q3_K_S",
          "iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL", "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS"}


def main(src: str, dst: str, kind: str) -> None:
    import llama_cpp

    if kind not in FTYPES:
        sys.exit(f"unknown type {kind!r}: one of {', '.join(FTYPES)}")
    if not Path(src).is_file():
        sys.exit(f"{src}: no such file")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        sys.exit(f"llama.cpp could not quantize {src}")
    print(f"{dst}: {Path(dst).stat().st_size / 2**20:.0f} MiB ({kind})")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
