"""IQ1/IQ2/IQ3 GGUF files and blocks made by llama.cpp's own quantizer, with a uniform importance matrix.

llama.cpp refuses IQ2_XXS, IQ2_XS, IQ2_S and IQ1 files without an importance matrix (`llama_model_quantize`,
scripts/quantize_gguf.py), and llama-cpp-python ships no imatrix tool. Its ggml library does export the
quantizer itself, `ggml_quantize_chunk(type, src, dst, start, rows, n_per_row, imatrix)`: this script calls
it through ctypes with an importance of 1 for every column (what an importance matrix estimates on
activations that favour no column; random-weight models have no better one). Run with the main venv (it
needs gguf-py); the library is the llama.cpp peer's (make llamacpp-venv):

    .venv/bin/python scripts/quantize_iq_gguf.py IN.bf16.gguf OUT.gguf iq2_xxs   # a whole model
    .venv/bin/python scripts/quantize_iq_gguf.py --blocks tests/data/iq_blocks.npz  # the tests' blocks

A model: every matrix of the transformer blocks in the type, token_embd Q2_K and output Q5_K (llama.cpp's
choice for its IQ2 and IQ1 file types), norms and biases as they are (F32).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
IQ = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
EDGES = {"token_embd.weight": "Q2_K", "output.weight": "Q5_K"}  # llama.cpp's types there for its IQ2 and IQ1 files


def ggml():
    """llama-cpp-python's libggml-base (the llama.cpp peer's venv, or MARGINGATE_GGML_LIB)."""
    where = ".venv-llamacpp/lib/python*/site-packages/llama_cpp/lib/libggml-base.so"
    found = sorted(glob.glob(str(ROOT / where)) + glob.glob(str(ROOT.parent / "main" / where)))
    path = os.environ.get("MARGINGATE_GGML_LIB") or (found[0] if found else None)
    if path is None:
        sys.exit("no libggml-base.so: make llamacpp-venv, or set MARGINGATE_GGML_LIB")
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def quantize(lib, x: np.ndarray, type_name: str, threads: int = 1) -> np.ndarray:
    """[n, k] fp32 rows as blocks of `type_name` ([n, row bytes] uint8), importance 1 for every column."""
    import gguf

    ty = gguf.GGMLQuantizationType[type_name]
    size, nbytes = gguf.GGML_QUANT_SIZES[ty]
    x = np.ascontiguousarray(x, np.float32)
    n, k = x.shape
    out = np.zeros((n, k // size * nbytes), np.uint8)
    imatrix = np.ones(k, np.float32)
    step = max(1, -(-n // (4 * threads)))

    def run(r0: int) -> None:  # ctypes lets go of the GIL: the chunks run in parallel
        rows = min(step, n - r0)
        lib.ggml_quantize_chunk(int(ty), x[r0:].ctypes.data, out[r0:].ctypes.data, 0, rows, k, imatrix.ctypes.data)
    run(0)  # the first call builds the type's grid tables (not thread-safe to race)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(step, n, step)))
    return out


def blocks(dst: str) -> None:
    """Per IQ type, 16 rows of 512 Gaussian weights (each row its own scale) as llama.cpp quantizes them."""
    lib, rng = ggml(), np.random.default_rng(64)
    x = (rng.standard_normal((16, 512)) * np.exp(rng.standard_normal((16, 1)) * 2) * 0.02).astype(np.float32)
    np.savez_compressed(dst, **{t: quantize(lib, x, t) for t in IQ})
    print(f"{dst}: {', '.join(IQ)}")


def model(src: str, dst: str, type_name: str, threads: int = 2) -> None:
    import gguf

    lib, reader = ggml(), gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = [int(v) for v in reversed(t.shape)]  # [rows, k]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        kind = type_name if t.name.startswith("blk.") else EDGES.get(t.name)
        if len(shape) != 2 or kind is None:
            w.add_tensor(t.name, values)
            continue
        w.add_tensor(t.name, quantize(lib, values, kind, threads), raw_dtype=gguf.GGMLQuantizationType[kind])
        print(f"{t.name}: {kind}", flush=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{dst}: {Path(dst).stat().st_size / 2**20:.0f} MiB ({type_name})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--blocks":
        blocks(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[3].upper() in IQ:
        model(sys.argv[1], sys.argv[2], sys.argv[3].upper())
    else:
        sys.exit(__doc__)
