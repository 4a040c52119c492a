"""A BF16 GGUF of a model's BF16 cache: the weights our engine decodes, in the file format llama.cpp reads.

The embedded models ship as a quantized GGUF (Q4_1, Q8_0 embeddings) that the loader dequantizes
once to a BF16 safetensors cache. Handing llama.cpp that quantized file would compare different
weights; this writes the cache back into a GGUF instead:

* metadata: every key-value of the embedded GGUF (architecture, shapes, rope, tokenizer, chat
  template), with `general.file_type` set to BF16;
* tensors: GGUF names and the q/k row order llama.cpp expects for Llama, the exact inverse of the
  loader's map (`gguf_import.hf_name`, `gguf_import.unpermute`). 2-D tensors are BF16, bit for bit. The
  1-D norm weights are F32, as llama.cpp's own converter writes them (ggml multiplies F32
  activations by them and has no F32 x BF16 elementwise kernel); BF16 -> F32 is exact, so they
  hold the same numbers.

The file is written once, next to the model folder, keyed by the model fingerprint.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from .gguf_import import hf_name
from .loader import EMBEDDED, embedded_gguf_path, load_config, load_state_dict

FILE_TYPE_BF16 = 32  # llama_ftype LLAMA_FTYPE_MOSTLY_BF16 ("except 1d tensors")


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face q/k rows -> llama.cpp's (the rotary halves of each head interleaved); the inverse
    of `gguf_import.unpermute`."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def source_gguf(folder: Path) -> Path:
    """The embedded GGUF a cache folder was converted from (its metadata is copied)."""
    name = json.loads((Path(folder) / "config.json").read_text()).get("source_gguf")
    for model, (_, filename) in EMBEDDED.items():
        if name == filename:
            return embedded_gguf_path(model)
    raise ValueError(f"{folder} was not converted from an embedded GGUF ({', '.join(EMBEDDED)}): a BF16 GGUF "
                     "needs the embedded file's architecture and tokenizer metadata, so only embedded models "
                     "can be exported")


def bf16_gguf_path(folder: Path) -> Path:
    folder = Path(folder)
    return folder.with_name(f"{folder.name}-{load_config(folder).fingerprint()}.bf16.gguf")


def bf16_gguf(folder: Path) -> Path:
    """The BF16 GGUF of `folder`'s weights, written on first use and cached beside the folder."""
    path = bf16_gguf_path(folder)
    if not path.exists():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            write_bf16_gguf(folder, tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _tensor(name: str, w: torch.Tensor, meta: dict) -> torch.Tensor:
    arch = meta["general.architecture"]
    if name.endswith(".attn_q.weight"):
        return permute(w, int(meta[f"{arch}.attention.head_count"]))
    if name.endswith(".attn_k.weight"):
        return permute(w, int(meta[f"{arch}.attention.head_count_kv"]))
    return w


def write_bf16_gguf(folder: Path, out: Path, source: Path | None = None) -> Path:
    """Write `folder`'s BF16 safetensors as a GGUF at `out`, with the metadata of `source`
    (default: the embedded GGUF the folder was converted from)."""
    import gguf

    reader = gguf.GGUFReader(str(source or source_gguf(folder)))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    state = load_state_dict(Path(folder), torch.bfloat16)
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # written by the writer itself
            continue
        if key == "general.file_type":
            writer.add_uint32(key, FILE_TYPE_BF16)
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    used = set()
    for t in reader.tensors:  # the source's names and order; our values
        name = hf_name(t.name)
        if name not in state:
            raise ValueError(f"{folder} has no {name} (GGUF {t.name})")
        used.add(name)
        w = _tensor(t.name, state[name], meta).contiguous()
        if w.dim() == 1:
            writer.add_tensor(t.name, w.float().numpy())
        else:
            writer.add_tensor(t.name, w.view(torch.int16).numpy().view(np.uint16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    if set(state) - used:
        raise ValueError(f"{folder} holds tensors the GGUF has no place for: {sorted(set(state) - used)[:4]}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def read_tensor(t) -> torch.Tensor:
    """A tensor of a `gguf.GGUFReader` as torch, BF16 or F32 (in our row order: q/k un-permuted by
    the caller)."""
    import gguf

    data = np.array(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        rows = data.view(np.int16).reshape(*data.shape[:-1], -1)
        return torch.from_numpy(rows).view(torch.bfloat16)
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(data)
    raise ValueError(f"{t.name}: {t.tensor_type.name} is neither BF16 nor F32")
