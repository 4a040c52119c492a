"""Hostile model files: GGUF and safetensors headers from the embedded model, mutated by a seeded
mutator. Each case ends in a named error (`GGUFError`, `WeightsError`) or a valid read of every
tensor, within seconds and with bounded memory: never a crash, a hang, another exception, or an
allocation that the header sized.

The GGUF cases mutate the fields that give the header its structure (counts, lengths, value and
tensor types, dimensions, offsets: their places found by gguf's own reader on the unmutated file)
and random header bytes, of a small GGUF made from the embedded model (its metadata with the first
256 tokens, and four of its tensors, in their own types). The safetensors cases mutate the header
of a small file of the embedded model's tensors: the length field, each entry's dtype, shape and
data offsets, and random bytes.
"""
from __future__ import annotations

import json
import random
import resource
import struct
import time

import numpy as np
import pytest

from margingate.models import gguf_import, loader
from margingate.models.gguf_import import GGUFError
from margingate.models.safetensors_file import mmap_safetensors
from margingate.models.weights import WeightsError

gguf = pytest.importorskip("gguf")

CASES = 300          # per format; seeded, so every run tries the same files
SECONDS = 5.0        # the most one case may take (a loaded 2-core machine included)
GROWTH = 256 << 20   # the most the process's peak memory may grow over all cases
KEEP = ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight")


def run_cases(cases, read, named: type[Exception]) -> dict:
    """Each (label, bytes) case written and read; the named errors by kind, every other outcome a failure."""
    peak, outcomes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, {"read": 0, "refused": 0}
    for label, path, data in cases:
        path.write_bytes(data)
        t = time.perf_counter()
        try:
            read(path)
            outcomes["read"] += 1
        except named:
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001  (any other outcome is the failure this test looks for)
            pytest.fail(f"{label}: {type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - t
        assert seconds < SECONDS, f"{label}: {seconds:.1f} s"
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
    assert growth < GROWTH, f"peak memory grew by {growth / 2**20:.0f} MiB"
    print(f"{len(cases)} cases: {outcomes}, peak memory +{growth / 2**20:.0f} MiB")  # shown with pytest -s
    return outcomes


# --- GGUF --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """The embedded model's metadata (tokenizer arrays cut to 256 entries) and four of its tensors."""
    source = gguf.GGUFReader(str(loader.embedded_gguf_path("smollm2-135m")))
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    for name, field in source.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own counts, and what the writer adds itself
        value, kind = field.contents(), field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value[:256] if sub is not None else value, kind, sub_type=sub)
    for t in source.tensors:
        if t.name in KEEP:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def structural_fields(path) -> list[tuple[int, int]]:
    """(byte position, width) of every count, length, type, dimension and offset in the header."""
    reader = gguf.GGUFReader(str(path))
    base = reader.data.ctypes.data
    out = [(4, 4), (8, 8), (16, 8)]  # the version, the tensor count, the metadata count
    metadata = [(f, set(f.data)) for n, f in reader.fields.items() if not n.startswith("GGUF.")]
    for field, values in metadata + [(t.field, set()) for t in reader.tensors]:  # a tensor's parts: all structure
        for i, part in enumerate(field.parts):
            if part.dtype in (np.uint32, np.uint64) and i not in values:
                out += [(part.ctypes.data - base + k * part.itemsize, part.itemsize) for k in range(part.size)]
    return out


def mutate_gguf(data: bytes, fields: list[tuple[int, int]], rng: random.Random) -> tuple[str, bytes]:
    out = bytearray(data)
    if rng.random() < 0.75:
        at, width = rng.choice(fields)
        fmt = "<I" if width == 4 else "<Q"
        old = struct.unpack_from(fmt, out, at)[0]
        top = (1 << (8 * width)) - 1
        new = rng.choice([0, 1, old - 1, old + 1, 2 * old, 1 << 31, 1 << 32, top >> 1, top, rng.getrandbits(8 * width)])
        struct.pack_into(fmt, out, at, new & top)
        return f"field at byte {at}: {old} -> {new & top}", bytes(out)
    spots = [rng.randrange(24, len(data) // 4) for _ in range(rng.randint(1, 4))]
    for at in spots:
        out[at] = rng.randrange(256)
    return f"bytes at {spots}", bytes(out)


def read_gguf(path) -> None:
    """What the converter reads before it writes a tensor: the header, the architecture, each tensor's
    name and its dequantized data."""
    [reader] = gguf_import.readers([path])
    arch = gguf_import.architecture(gguf_import.metadata(reader), path)
    for t in reader.tensors:
        gguf_import.hf_name(t.name, arch)
        t.dequantized()


def test_mutated_gguf_headers_end_in_a_named_error_or_a_valid_read(small_gguf, tmp_path):
    data, fields = small_gguf.read_bytes(), structural_fields(small_gguf)
    read_gguf(small_gguf)  # the unmutated file reads
    rng = random.Random(35)
    cases = [(label, tmp_path / "case.gguf", mutated) for label, mutated in
             (mutate_gguf(data, fields, rng) for _ in range(CASES))]
    outcomes = run_cases(cases, read_gguf, GGUFError)
    assert outcomes["refused"] > CASES // 2 and outcomes["read"] > 0, outcomes  # both ends were reached


# --- safetensors ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_safetensors(model_dir, tmp_path_factory):
    """Four of the embedded model's tensors (bf16), as the converter writes them."""
    from safetensors.torch import save_file

    state = mmap_safetensors(model_dir / "model.safetensors")
    keep = ("model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.mlp.down_proj.weight")
    path = tmp_path_factory.mktemp("st") / "small.safetensors"
    save_file({k: state[k].clone() for k in keep}, str(path))
    return path


def mutate_header(header: dict, rng: random.Random) -> str:
    name = rng.choice([k for k in header if k != "__metadata__"])
    entry = header[name]
    key = rng.choice(["dtype", "shape", "data_offsets", "drop"])
    if key == "drop":
        entry.pop(rng.choice(list(entry)))
    elif key == "dtype":
        entry["dtype"] = rng.choice(["F32", "F64", "I8", "BOOL", "F8_E4M3", "", 7, None, ["BF16"]])
    elif key == "shape":
        shape = entry["shape"]
        entry["shape"] = rng.choice([shape[::-1], shape + [1], shape[:-1], [-shape[0], *shape[1:]],
                                     [2 ** 62, *shape[1:]], [shape[0] + 1, *shape[1:]], [1.5], [True], "576", None])
    else:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice([[b, a], [a, b + 2], [a + 2, b + 2], [a, 2 ** 63], [-2, b], [a], None,
                                            [a, b, b], [str(a), b], [0, b - a]])
    return f"{name}.{key}: {entry.get(key, 'dropped')!r}"


def mutate_safetensors(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    length = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8:8 + length]), data[8 + length:]
    roll = rng.random()
    if roll < 0.6:
        label = mutate_header(header, rng)
        raw = json.dumps(header).encode()
        return label, len(raw).to_bytes(8, "little") + raw + body
    if roll < 0.8:
        new = rng.choice([0, 1, length - 1, length + 1, len(data), 2 ** 40, 2 ** 64 - 1])
        return f"header length {new}", new.to_bytes(8, "little") + data[8:]
    out = bytearray(data)
    spots = [rng.randrange(8, 8 + length) for _ in range(rng.randint(1, 4))]
    for at in spots:
        out[at] = rng.randrange(256)
    return f"header bytes at {spots}", bytes(out)


def read_safetensors(path) -> None:
    for tensor in mmap_safetensors(path).values():
        tensor.float().sum()  # every byte of every view is read


def test_mutated_safetensors_headers_end_in_a_named_error_or_a_valid_read(small_safetensors, tmp_path):
    data = small_safetensors.read_bytes()
    read_safetensors(small_safetensors)
    rng = random.Random(35)
    cases = [(label, tmp_path / "case.safetensors", mutated) for label, mutated in
             (mutate_safetensors(data, rng) for _ in range(CASES))]
    outcomes = run_cases(cases, read_safetensors, WeightsError)
    assert outcomes["refused"] > CASES // 2 and outcomes["read"] > 0, outcomes
