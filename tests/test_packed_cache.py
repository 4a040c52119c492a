"""The packed matrices of a GGUF kept in the cache: a second load maps them and packs nothing, with the
bits of a fresh pack (logits compared bit for bit); the key follows the file's bytes, not its path; a
damaged cache file is said and rebuilt. The models are the small random ones of test_gguf_import."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from kv_helpers import request_pool
from test_gguf_import import _source_model, _write_gguf

from margingate.kernels.packing import PackedWeight
from margingate.kernels.quant_pack import QuantWeight
from margingate.models import gguf_import, loader, packed_cache, weights
from margingate.models.decoder import AttentionPlan, DecoderModel

gguf = pytest.importorskip("gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of its own, and every file cached however small."""
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(packed_cache, "MIN_BYTES", 0)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small random Llama as Q8_0 and as F16 GGUF files, each with its config folder: {qtype: (file, folder)}."""
    source, out = _source_model("llama"), {}
    for qtype in ("Q8_0", "F16"):
        path = tmp_path_factory.mktemp(qtype) / "tiny.gguf"
        _write_gguf(source, "llama", getattr(gguf.GGMLQuantizationType, qtype), [path])
        gguf_import.convert([path], path.parent / "folder", tensors=False)
        out[qtype] = path, path.parent / "folder"
    return out


def _state(file, contract: str):
    path, folder = file
    return loader.load_state_dict(folder, gguf=[path], contract=contract)


def _load(file, contract: str) -> DecoderModel:
    return DecoderModel(loader.load_config(file[1]), _state(file, contract))


def _logits(model: DecoderModel) -> torch.Tensor:
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    kv, tables = request_pool(c, 1, 64, torch.bfloat16)
    n = len(tokens)
    return model.forward(tokens, torch.arange(n), tables, torch.zeros(n, dtype=torch.long),
                         AttentionPlan.all_exact(n), kv)


def _matrices(model: DecoderModel) -> list:
    W = model.own_weights
    return [m for L in W.layers for m in L.matrices()] + [W.lm_head, W.embed]


@pytest.mark.parametrize("qtype,contract,kind", [("Q8_0", "int8", QuantWeight), ("Q8_0", "exact", QuantWeight),
                                                 ("F16", "int8", PackedWeight)])
def test_a_model_mapped_from_the_cache_gives_the_freshly_packed_logits_bit_for_bit(
        qtype, contract, kind, files, cache, monkeypatch):
    fresh = _load(files[qtype], contract)
    assert fresh.own_weights.layers[0].qkv.__class__ is kind
    kept = list((cache / "packed").glob("*.safetensors"))
    assert len(kept) == 1 and f"-{contract}-" in kept[0].name

    def refuse(*args, **kwargs):
        raise AssertionError("a load from the cache packed a matrix again")
    monkeypatch.setattr(weights, "quant_weight", refuse)
    monkeypatch.setattr(weights, "pack", refuse)
    mapped = _load(files[qtype], contract)
    assert _state(files[qtype], contract).packed_cache.outcome == "hit"
    for a, b in zip(_matrices(fresh), _matrices(mapped), strict=True):
        assert type(a) is type(b) and a.shape == b.shape and torch.equal(a.data, b.data)
    want, got = _logits(fresh), _logits(mapped)
    assert torch.equal(want.view(torch.int32), got.view(torch.int32))


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose map holds t's bytes (/proc/self/maps), or None for anonymous memory."""
    at = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= at < hi:
            return rest[4] if len(rest) > 4 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
def test_a_first_load_ends_on_the_cache_files_map_with_no_copy_of_its_own(qtype, files, cache):
    """The packing load's matrices are moved onto the file it wrote: what a later load maps, not an anonymous
    copy (nor the spill they went through while the model was built)."""
    fresh = _load(files[qtype], "int8")
    [kept] = (cache / "packed").glob("*.safetensors")
    packed = [m for m in _matrices(fresh) if isinstance(m, (PackedWeight, QuantWeight))]  # F16's embedding: plain
    assert len(packed) > 4 and {_mapped_file(m.data) for m in packed} == {str(kept)}
    assert torch.equal(_logits(fresh).view(torch.int32), _logits(_load(files[qtype], "int8")).view(torch.int32))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_huge_weights_memory_reads_the_streamed_matrices_into_own_memory_with_the_same_bits(
        files, cache, monkeypatch):
    """MARGINGATE_WEIGHTS_MEMORY=huge: a later load's matrices (the embedding aside) are in anonymous memory,
    2 MiB aligned as one buffer, each byte the file's; the logits bit for bit those of the mapped load."""
    mapped = _load(files["Q8_0"], "int8")
    [kept] = (cache / "packed").glob("*.safetensors")
    monkeypatch.setenv("MARGINGATE_WEIGHTS_MEMORY", "huge")
    own = _load(files["Q8_0"], "int8")
    streamed = [m for L in own.own_weights.layers for m in L.matrices()] + [own.own_weights.lm_head]
    assert {_mapped_file(m.data) for m in streamed} == {None}
    assert min(m.data.data_ptr() for m in streamed) % (2 << 20) == 0
    assert _mapped_file(own.own_weights.embed.data) == str(kept)
    for a, b in zip(_matrices(mapped), _matrices(own), strict=True):
        assert torch.equal(a.data, b.data)
    assert torch.equal(_logits(mapped).view(torch.int32), _logits(own).view(torch.int32))
    monkeypatch.setenv("MARGINGATE_WEIGHTS_MEMORY", "hug")
    with pytest.raises(ValueError, match="MARGINGATE_WEIGHTS_MEMORY='hug'.*mapped, huge"):
        _load(files["Q8_0"], "int8")


def test_the_cache_file_is_written_in_whole_2_mib_pieces_at_2_mib_offsets(tmp_path, monkeypatch):
    """WholePieces: the bytes of writes of every size, in order, and each system call but the last covers whole
    2 MiB pieces from a 2 MiB offset (what lets the page cache hold the file in 2 MiB folios)."""
    calls, writev = [], os.writev

    def recording(fd, buffers):
        calls.append((os.lseek(fd, 0, os.SEEK_CUR), sum(len(b) for b in buffers)))
        return writev(fd, buffers)

    monkeypatch.setattr(packed_cache.os, "writev", recording)
    rng = torch.Generator().manual_seed(0)
    sizes = [8, 3 << 20, 64, 1, (9 << 20) + 5, 4096, 17 << 20, 100]
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes() for n in sizes]
    with open(tmp_path / "f", "wb", buffering=0) as raw:
        f = packed_cache.WholePieces(raw)
        for part in parts:
            f.write(part)
        assert f.tell() == sum(sizes)
        f.close()
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
    assert len(calls) >= 2 and all(at % (2 << 20) == 0 for at, _ in calls)
    assert all(n % (2 << 20) == 0 for _, n in calls[:-1])


def test_the_key_follows_the_files_bytes_contract_and_layout_not_its_path(files, tmp_path, monkeypatch):
    a = files["Q8_0"][0]
    moved = tmp_path / "elsewhere" / "b.gguf"
    moved.parent.mkdir()
    shutil.copy2(a, moved)  # the same bytes and mtime at another path
    key = packed_cache.cache_key([a], "int8")
    assert packed_cache.cache_key([moved], "int8") == key
    assert packed_cache.cache_key([a], "exact") != key
    data = bytearray(moved.read_bytes())
    data[-100] ^= 1  # one byte of the last tensor (the end is sampled), the size and mtime kept
    stat = moved.stat()
    moved.write_bytes(bytes(data))
    os.utime(moved, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert packed_cache.cache_key([moved], "int8") != key
    monkeypatch.setattr(packed_cache, "LAYOUT_VERSION", packed_cache.LAYOUT_VERSION + 1)
    assert packed_cache.cache_key([a], "int8") != key


@pytest.mark.parametrize("damage", ["truncated", "other key", "not safetensors"])
def test_a_damaged_cache_file_is_said_and_rebuilt(damage, files, cache, capsys):
    file = files["Q8_0"]
    want = _logits(_load(file, "int8"))
    [kept] = (cache / "packed").glob("*.safetensors")
    data = kept.read_bytes()
    if damage == "truncated":
        kept.write_bytes(data[:len(data) // 2])
    elif damage == "other key":
        key = packed_cache.cache_key([file[0]], "int8").encode()
        kept.write_bytes(data.replace(key, b"0" * len(key), 1))
    else:
        kept.write_bytes(b"\xff" * 64)
    capsys.readouterr()
    again = _load(file, "int8")
    assert "is not usable" in capsys.readouterr().err
    assert torch.equal(_logits(again).view(torch.int32), want.view(torch.int32))
    assert _state(file, "int8").packed_cache.outcome == "hit"  # rebuilt whole


def test_a_small_file_is_not_cached(files):
    assert files["Q8_0"][0].stat().st_size < packed_cache.MIN_BYTES
    assert packed_cache.PackedCache.for_gguf([files["Q8_0"][0]], "int8", Path("unused")) is None


def test_files_long_unused_or_whose_gguf_is_gone_and_a_killed_writes_leftover_are_pruned(tmp_path):
    folder, model = tmp_path / "packed", tmp_path / "model.gguf"
    folder.mkdir()
    model.write_bytes(b"")
    files = {name: folder / f"{name}-int8-0.safetensors" for name in ("old", "recent", "gone")}
    for name, f in files.items():
        source = model if name != "gone" else tmp_path / "deleted.gguf"
        packed_cache._write(f, {}, {"key": "0", "sources": json.dumps([str(source)])})
    tmp = folder / ".c.123.tmp"
    tmp.write_bytes(b"")
    long_ago = time.time() - 40 * 86400
    os.utime(files["old"], (long_ago, long_ago))
    os.utime(tmp, (time.time() - 7200,) * 2)
    packed_cache.prune(folder)
    assert [f.exists() for f in files.values()] == [False, True, False] and not tmp.exists()
