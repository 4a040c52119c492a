"""The BF16 GGUF written for llama.cpp (models/gguf_export.py) holds our BF16 cache bit for bit,
under the loader's own map read backwards, with the embedded file's tokenizer; no llama.cpp needed."""
from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory):
    from margingate.models.gguf_export import write_bf16_gguf

    out = write_bf16_gguf(model_dir, tmp_path_factory.mktemp("gguf") / "model.bf16.gguf")
    return gguf.GGUFReader(str(out))


def test_permute_inverts_the_loaders_unpermute():
    from margingate.models.gguf_export import permute
    from margingate.models.gguf_import import unpermute as _unpermute

    w = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(24, 5)
    assert torch.equal(_unpermute(permute(w, 3), 3), w)
    assert not torch.equal(permute(w, 3), w)


def test_every_tensor_is_our_bf16_weight_bitwise(written, model_dir):
    from margingate.models.gguf_export import read_tensor
    from margingate.models.gguf_import import hf_name
    from margingate.models.gguf_import import unpermute as _unpermute
    from margingate.models.loader import load_state_dict

    ours = load_state_dict(model_dir, torch.bfloat16)
    heads = int(written.fields["llama.attention.head_count"].contents())
    kv = int(written.fields["llama.attention.head_count_kv"].contents())
    seen = set()
    for t in written.tensors:
        name = hf_name(t.name)
        back = read_tensor(t)
        if t.name.endswith(".attn_q.weight"):
            back = _unpermute(back, heads)
        elif t.name.endswith(".attn_k.weight"):
            back = _unpermute(back, kv)
        want = ours[name]
        assert back.shape == want.shape, t.name
        if back.dtype == torch.float32:  # 1-D norms: an exact upcast of our BF16 values
            assert back.dim() == 1, t.name
            assert torch.equal(back, want.float()), t.name
            back = back.to(torch.bfloat16)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16, t.name
        assert torch.equal(back.view(torch.int16), want.view(torch.int16)), t.name
        seen.add(name)
    assert seen == set(ours)


def test_metadata_is_the_embedded_files_with_bf16_file_type(written, model_dir):
    from margingate.models.gguf_export import FILE_TYPE_BF16, source_gguf

    src = gguf.GGUFReader(str(source_gguf(model_dir)))
    assert written.fields["general.file_type"].contents() == FILE_TYPE_BF16
    assert written.fields["general.architecture"].contents() == "llama"
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id",
                "tokenizer.chat_template", "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
                "llama.block_count", "llama.context_length"):
        assert written.fields[key].contents() == src.fields[key].contents(), key
    assert len(written.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_cache_path_is_beside_the_model_keyed_by_fingerprint(model_dir):
    from margingate.models.gguf_export import bf16_gguf_path
    from margingate.models.loader import load_config

    path = bf16_gguf_path(model_dir)
    assert path.parent == model_dir.parent
    assert path.name == f"{model_dir.name}-{load_config(model_dir).fingerprint()}.bf16.gguf"


def test_written_once(model_dir, tmp_path, monkeypatch):
    from margingate.models import gguf_export

    calls = []  # the writing itself is checked above; here only that it happens once, atomically
    monkeypatch.setattr(gguf_export, "bf16_gguf_path", lambda folder: tmp_path / "m.bf16.gguf")
    monkeypatch.setattr(gguf_export, "write_bf16_gguf", lambda folder, out: calls.append(out) or out.write_bytes(b"x"))
    first = gguf_export.bf16_gguf(model_dir)
    assert gguf_export.bf16_gguf(model_dir) == first == tmp_path / "m.bf16.gguf"
    assert len(calls) == 1 and first.exists() and list(tmp_path.iterdir()) == [first]
