"""A GGUF of a model folder's weights, BF16 or quantized: the weights our engine decodes, in the file format
llama.cpp reads.

The embedded models ship as a quantized GGUF (Q4_1, Q8_0 embeddings) that the loader dequantizes
once to a BF16 safetensors cache. Handing llama.cpp that quantized file would compare different
weights; this writes the folder back into a GGUF instead:

* metadata, for a folder converted from an embedded GGUF: every key-value of that file
  (architecture, shapes, rope, tokenizer, chat template), with `general.file_type` set to BF16;
* metadata, for any other Llama-family folder (LlamaForCausalLM, MistralForCausalLM as llama.cpp's
  `llama`, Qwen2ForCausalLM as its `qwen2`): written from config.json and the tokenizer files, as
  llama.cpp's convert_hf_to_gguf.py writes them (`gguf_tokenizer.py`). What llama.cpp's llama and
  qwen2 architectures cannot run (Gemma 3) is refused by name. The GGUF holds what our forward
  computes: plain RoPE at rope_theta (a config with RoPE scaling is refused by name) and no sliding window;
* tensors: GGUF names and the q/k row order llama.cpp expects for Llama (biases too), the exact
  inverse of the loader's map (`gguf_import.hf_name`, `gguf_import.unpermute`). 2-D tensors are BF16,
  bit for bit, or with `quantize` ("q8_0", "q4_k") the very blocks `LLM(folder, quantize=...)` runs
  (models/quantize.py: the same types, fallbacks and bytes; quantized after the Q/K permutation, which
  moves whole rows). The 1-D norm weights and biases are F32, as llama.cpp's own converter writes them
  (ggml multiplies F32 activations by them and has no F32 x BF16 elementwise kernel); BF16 -> F32 is
  exact, so they hold the same numbers. Tensors are read and written one at a time: an 8B model's
  export needs about one tensor of memory, not the model's.

The BF16 file the benchmarks hand llama.cpp is written once, next to the model folder, keyed by the
model fingerprint (and, for a folder not converted from an embedded GGUF, by its safetensors files'
sizes and times, as its weights can change under the same shape). `margingate export` writes any of
them where it is asked to.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from . import fused_experts
from .gguf_names import ARCHS, expert_names, gguf_name, hf_name, permute
from .gguf_tokenizer import add_tokenizer
from .loader import EMBEDDED, embedded_gguf_path, load_config
from .quantize import block_type, quantize_rows
from .weights import WeightsError

FILE_TYPE_BF16 = 32  # llama_ftype LLAMA_FTYPE_MOSTLY_BF16 ("except 1d tensors")
# general.file_type by --quantize: MOSTLY_Q8_0; MOSTLY_Q4_K_S, llama.cpp's name for Q4_K wherever it fits
FILE_TYPES = {None: FILE_TYPE_BF16, "q8_0": 7, "q4_k": 14}
# HF architecture -> our key of the llama.cpp architecture that runs it (gguf_names.ARCHS; convert_hf_to_gguf.py
# writes Mistral as llama, and Mixtral as llama with experts).
LLAMA_CPP_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "mixtral",
                   "GptOssForCausalLM": "gpt-oss"}
_SKIPPED = (".rotary_emb.inv_freq",)  # buffers older checkpoints carry; the forward recomputes them


def source_gguf(folder: Path) -> Path | None:
    """The embedded GGUF a cache folder was converted from (its metadata is copied); None for any
    other folder (its metadata is written from config.json and the tokenizer files)."""
    name = json.loads((Path(folder) / "config.json").read_text()).get("source_gguf")
    for model, (_, filename) in EMBEDDED.items():
        if name == filename:
            return embedded_gguf_path(model)
    return None


def bf16_gguf_path(folder: Path) -> Path:
    folder = Path(folder)
    key = load_config(folder).fingerprint()
    if source_gguf(folder) is None:
        files = sorted(folder.glob("*.safetensors"))
        stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        key += "-" + hashlib.sha256(repr(stamp).encode()).hexdigest()[:8]
    return folder.with_name(f"{folder.name}-{key}.bf16.gguf")


def bf16_gguf(folder: Path) -> Path:
    """The BF16 GGUF of `folder`'s weights, written on first use and cached beside the folder."""
    path = bf16_gguf_path(folder)
    if not path.exists():
        write_atomically(path, lambda tmp: write_bf16_gguf(folder, tmp))
    return path


def write_atomically(path: Path, write) -> Path:
    """`write(tmp)` to a file beside `path`, then renamed to it: a reader never sees half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class _Tensors(contextlib.ExitStack):
    """A folder's safetensors tensors by name, each read when asked for, in BF16 as the loader reads them;
    gpt-oss's fused experts by the per-expert names the loader gives them (`fused_experts.pieces`)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder, self.files, self.cuts, self._fused = folder, {}, {}, (None, None)

    def __enter__(self) -> _Tensors:
        from safetensors import safe_open

        super().__enter__()
        try:
            for f in sorted(self.folder.glob("*.safetensors")):
                handle = self.enter_context(safe_open(str(f), "pt"))
                for k in handle.keys():
                    if k in self.files:
                        raise WeightsError(f"{k} appears in more than one file of {self.folder} (again in {f.name})")
                    self.files[k] = handle
        except BaseException:
            self.close()  # the files opened so far: no __exit__ follows a failed __enter__
            raise
        self.cuts = fused_experts.pieces(load_config(self.folder), self.files)
        return self

    @property
    def names(self) -> list[str]:
        fused = {f for f, _, _ in self.cuts.values()}
        return [n for n in self.files if n not in fused] + list(self.cuts)

    def has(self, name: str) -> bool:
        return name in self.files or name in self.cuts

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.cuts:
            return tuple(self.get(name).shape)
        return tuple(self.files[name].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name in self.cuts:  # the last fused tensor read is kept: its experts are asked for one after another
            fused, e, cut = self.cuts[name]
            if self._fused[0] != fused:
                self._fused = (fused, self.files[fused].get_tensor(fused).to(torch.bfloat16))
            return cut(self._fused[1][e]).contiguous()
        return self.files[name].get_tensor(name).to(torch.bfloat16)


def _ignored(name: str, tied: bool) -> bool:
    # As our loader: a tied model's head is its embedding, whatever the folder holds.
    return name.endswith(_SKIPPED) or (tied and name == "lm_head.weight")


def write_bf16_gguf(folder: Path, out: Path, source: Path | None = None) -> Path:
    """Write `folder`'s weights as a BF16 GGUF at `out` (`write_gguf`)."""
    return write_gguf(folder, out, source=source)


def write_gguf(folder: Path, out: Path, quantize: str | None = None, source: Path | None = None) -> Path:
    """Write `folder`'s weights as a GGUF at `out`: its matrices BF16, or quantized as `quantize` ("q8_0",
    "q4_k") quantizes them at load; with the metadata of `source` (default: the embedded GGUF the folder
    was converted from; none: written from the folder's own files)."""
    import gguf

    if quantize not in FILE_TYPES:
        raise ValueError(f"quantize must be one of {', '.join(q for q in FILE_TYPES if q)} or None; got {quantize!r}")
    folder = Path(folder)
    source = source or source_gguf(folder)
    with _Tensors(folder) as tensors:
        if source is not None:
            writer, arch, names, heads = _copied_metadata(gguf, source, out, FILE_TYPES[quantize])
        else:
            writer, arch, names, heads = _written_metadata(gguf, folder, out, tensors, FILE_TYPES[quantize])
        try:
            _write_tensors(gguf, writer, folder, (arch, heads), names, tensors, quantize)
        finally:
            writer.close()
    return Path(out)


def _copied_metadata(gguf, source: Path, out: Path, file_type: int):
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # written by the writer itself
            continue
        if key == "general.file_type":
            writer.add_uint32(key, file_type)
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    heads = tuple(int(reader.fields[f"{arch}.attention.{k}"].contents()) for k in ("head_count", "head_count_kv"))
    # the source's names and order; our values (an embedded file has no experts)
    return writer, arch, [t.name for t in reader.tensors], (*heads, 0)


def _written_metadata(gguf, folder: Path, out: Path, tensors: _Tensors, file_type: int):
    """The metadata convert_hf_to_gguf.py writes for a Llama-family folder, from our reading of it."""
    cfg = load_config(folder)
    arch = _llama_cpp_arch(cfg, folder)
    writer = gguf.GGUFWriter(str(out), ARCHS[arch].meta)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(folder.name)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.experts_per_token)
        if arch in ("qwen3moe", "gpt-oss"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate)
    if arch == "gpt-oss":  # what llama.cpp reads of it (the rest it fixes: _gpt_oss_fits checked them)
        writer.add_sliding_window(max(cfg.layer_windows))
        if cfg.rope_scaling:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(cfg.rope_scaling[1])
            writer.add_rope_scaling_orig_ctx_len(int(cfg.rope_scaling[4]))
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, folder, cfg.vocab_size)
    names = []
    for name in tensors.names:
        if _ignored(name, cfg.tie_embeddings):
            continue
        if gguf_name(name, arch) is None:
            raise ValueError(f"{folder}: {name} has no place in llama.cpp's {arch} architecture")
        names.append(gguf_name(name, arch))
    order = list(ARCHS[arch].layers)
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.num_experts)
    return writer, arch, sorted(dict.fromkeys(names), key=lambda n: _order(n, order)), shape


def _llama_cpp_arch(cfg, folder: Path) -> str:
    """Our key of the llama.cpp architecture that computes what our forward computes for `cfg`, or a
    ValueError naming what it would compute differently."""
    arch = LLAMA_CPP_ARCHS.get(cfg.architecture)
    if arch is None:
        raise ValueError(f"{folder}: {cfg.architecture} cannot be exported for llama.cpp: the GGUF "
                         f"export writes {', '.join(LLAMA_CPP_ARCHS)}; Gemma 3 needs its gemma3 architecture, "
                         "which it does not write")
    if arch == "gpt-oss":
        return _gpt_oss_fits(cfg, folder)
    if cfg.rope_scaling or cfg.rope_freq_factors:
        raise ValueError(f"{folder}: its RoPE scaling ({cfg.rope_scaling[0] if cfg.rope_scaling else 'rope_freqs'}) "
                         "is not written by the BF16 GGUF export (plain RoPE only): llama.cpp would run it unscaled")
    if cfg.num_experts and not cfg.norm_topk:
        raise ValueError(f"{folder}: norm_topk_prob is false, and llama.cpp's {arch} renormalizes the kept "
                         "experts' weights: it would run another model")
    if cfg.num_experts and cfg.moe_layers != tuple(range(cfg.num_layers)):
        raise ValueError(f"{folder}: only layers {list(cfg.moe_layers)} are MoE (decoder_sparse_step, "
                         f"mlp_only_layers); llama.cpp's {arch} makes every layer one")
    return arch


def _gpt_oss_fits(cfg, folder: Path) -> str:
    """llama.cpp's gpt-oss fixes what a config may vary: the even layers slide (one window), YaRN (or none) with
    betas 32 and 1, the clamped SwiGLU's 1.702 and 7.0. A folder that varies them is refused by name."""
    windows = {w for i, w in enumerate(cfg.layer_windows) if i % 2 == 0}
    if len(windows) != 1 or 0 in windows or any(cfg.layer_windows[1::2]):
        raise ValueError(f"{folder}: llama.cpp's gpt-oss slides every even layer by one window; this one's "
                         f"windows are {list(cfg.layer_windows)}")
    if cfg.rope_scaling and (cfg.rope_scaling[0] != "yarn" or cfg.rope_scaling[2:4] != (32.0, 1.0)):
        raise ValueError(f"{folder}: its RoPE scaling {cfg.rope_scaling[:4]} is not llama.cpp's gpt-oss YaRN")
    if cfg.swiglu != (1.702, 7.0):
        raise ValueError(f"{folder}: llama.cpp fixes gpt-oss's SwiGLU at alpha 1.702, limit 7.0; this one's is "
                         f"{cfg.swiglu}")
    return "gpt-oss"


def _order(name: str, layer_order: list[str]) -> tuple:
    """token_embd, the blocks in order (each as the architecture's layer names list them; weight before
    bias), output_norm, output."""
    parts = name.split(".")
    if parts[0] != "blk":
        return {"token_embd": 0, "output_norm": 2, "output": 3}[parts[0]], 0, 0, False
    return 1, int(parts[1]), layer_order.index(parts[2]), parts[-1] == "bias"


def _write_tensors(gguf, writer, folder: Path, arch_heads: tuple, names: list[str], tensors: _Tensors,
                   quantize: str | None) -> None:
    """Tensor infos first (the header needs every shape), then each tensor read, converted and written;
    `arch_heads`: (arch, (heads, KV heads, experts)). A mixture's experts are stacked: one [experts, rows, k]
    tensor per matrix, as llama.cpp reads them."""
    from tqdm import tqdm

    arch, (n_heads, n_kv, experts) = arch_heads
    heads = {".attn_q.": n_heads, ".attn_k.": n_kv} if ARCHS[arch].permuted else {}  # llama: q/k rows permuted
    plan = []
    for name in names:
        hfs = expert_names(hf_name(name, arch), experts)
        if not all(tensors.has(hf) for hf in hfs):
            raise ValueError(f"{folder} has no {next(hf for hf in hfs if not tensors.has(hf))} (GGUF {name})")
        dims = (len(hfs), *tensors.shape(hfs[0])) if len(hfs) > 1 else tensors.shape(hfs[0])
        kind, shape, dtype, nbytes = _layout(gguf, dims, quantize, bias=name.endswith(".bias"))
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes,
                               raw_dtype=None if kind == gguf.GGMLQuantizationType.F32 else kind)
        plan.append((name, hfs, kind, int(np.prod(dims))))
    tied = "output.weight" not in names
    used = {hf for p in plan for hf in p[1]}
    unused = sorted(set(tensors.names) - used - {k for k in tensors.names if _ignored(k, tied)})
    if unused:
        raise ValueError(f"{folder} holds tensors the GGUF has no place for: {unused[:4]}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=sum(p[-1] for p in plan), unit="weight", unit_scale=True, disable=len(plan) < 64, leave=False,
              desc=f"writing the {(quantize or 'bf16').upper()} GGUF") as bar:
        for name, hfs, kind, n in plan:
            count = next((c for part, c in heads.items() if part in name), None)
            parts = [_encode(gguf, _rows(tensors.get(hf), count), kind, hf) for hf in hfs]
            writer.write_tensor_data(np.stack(parts) if len(parts) > 1 else parts[0])
            bar.update(n)


def _rows(w: torch.Tensor, heads: int | None) -> torch.Tensor:
    return (permute(w, heads) if heads else w).contiguous()


def _layout(gguf, dims: tuple[int, ...], quantize: str | None, bias: bool = False) -> tuple:
    """How a tensor of (Hugging Face) shape `dims` is written: its GGML type, and the shape, dtype and
    size of what is handed to the writer. 1-D and biases (gpt-oss's experts' are stacked, 2-D): F32; 2-D
    (3-D: stacked experts): BF16, or quantize's block type for its rows."""
    n, types = int(np.prod(dims)), gguf.GGMLQuantizationType
    if len(dims) == 1 or bias:
        return types.F32, dims, np.float32, 4 * n
    kind = block_type(dims[-1], quantize) if quantize else None
    if kind is None:
        return types.BF16, dims, np.uint16, 2 * n
    block, size = gguf.GGML_QUANT_SIZES[types[kind]]
    return types[kind], (*dims[:-1], dims[-1] // block * size), np.uint8, n // block * size


def _encode(gguf, w: torch.Tensor, kind, name: str) -> np.ndarray:
    """A tensor's bytes as `_layout` planned them (`name`: the Hugging Face name, for errors)."""
    if kind == gguf.GGMLQuantizationType.F32:
        return w.float().numpy()
    if kind == gguf.GGMLQuantizationType.BF16:
        return w.view(torch.int16).numpy().view(np.uint16)
    return quantize_rows(w, kind.name, name)


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
