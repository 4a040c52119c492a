"""The BF16 GGUF written for llama.cpp (models/gguf_export.py) holds our BF16 cache bit for bit,
under the loader's own map read backwards, with the embedded file's tokenizer; no llama.cpp needed.
Any other Llama-family folder (the random-model script's, small transformers Llama and Qwen2 ones)
gets metadata written from its config.json and tokenizer files, read back and round-tripped through
our GGUF importer."""
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


# --- any Llama-family folder: metadata written from config.json and the tokenizer files ----------

TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def _hf_folder(kind: str, out, model_dir):
    """A small random transformers model saved in bf16, with the embedded model's tokenizer files."""
    import shutil

    import transformers as tf

    cfg_cls, model_cls, extra = {
        "llama-bias": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(attention_bias=True, tie_word_embeddings=False)),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=False)),
        "qwen3-moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, dict(
            head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
        # gpt-oss: fused experts in the folder, per-expert tensors on both sides of the GGUF
        "gpt-oss": (tf.GptOssConfig, tf.GptOssForCausalLM, dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                               sliding_window=32, tie_word_embeddings=False)),
    }[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:  # at 0 or 1 at init: no order shows
                torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.5)
    model.to(torch.bfloat16).save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / f, out / f)
    return out


@pytest.fixture(scope="module", params=["script-tiny", "llama-bias", "qwen2", "qwen3", "qwen3-moe", "mixtral",
                                        pytest.param("gpt-oss", marks=pytest.mark.slow)])
def plain(request, model_dir, tmp_path_factory):
    """(folder, its exported GGUF read back): a folder of no embedded GGUF (no `source_gguf`)."""
    from margingate.models.gguf_export import write_bf16_gguf

    out = tmp_path_factory.mktemp("plain") / request.param
    if request.param == "script-tiny":
        request.getfixturevalue("random_model_script").make("tiny", out, seed=1, progress=False)
    else:
        _hf_folder(request.param, out, model_dir)
    gguf_file = write_bf16_gguf(out, out.with_suffix(".gguf"))
    return out, gguf.GGUFReader(str(gguf_file))


@pytest.fixture(scope="module")
def embedded_tokenizer(model_dir):
    """The tokenizer keys of the embedded GGUF (read once: parsing its 49152 tokens takes seconds)."""
    from margingate.models.loader import embedded_gguf_path

    src = gguf.GGUFReader(str(embedded_gguf_path("smollm2-135m")))
    return {key: src.fields[key].contents() for key in TOKENIZER_KEYS}


def test_plain_folder_metadata_is_its_config_and_tokenizer(plain, embedded_tokenizer):
    from margingate.models.gguf_export import FILE_TYPE_BF16, source_gguf
    from margingate.models.loader import load_config

    folder, reader = plain
    assert source_gguf(folder) is None
    from margingate.models.gguf_export import LLAMA_CPP_ARCHS
    from margingate.models.gguf_names import ARCHS

    cfg = load_config(folder)
    arch = reader.fields["general.architecture"].contents()
    assert arch == ARCHS[LLAMA_CPP_ARCHS[cfg.architecture]].meta
    meta = {k: f.contents() for k, f in reader.fields.items()}
    assert meta["general.file_type"] == FILE_TYPE_BF16
    assert (meta[f"{arch}.block_count"], meta[f"{arch}.embedding_length"], meta[f"{arch}.feed_forward_length"],
            meta[f"{arch}.attention.head_count"], meta[f"{arch}.attention.head_count_kv"],
            meta[f"{arch}.context_length"], meta[f"{arch}.vocab_size"], meta[f"{arch}.rope.dimension_count"]) == (
        cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
        cfg.max_position, cfg.vocab_size, cfg.head_dim)
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    if cfg.num_experts:
        assert (meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]) == (4, 2)
        if arch == "qwen3moe":
            assert meta[f"{arch}.expert_feed_forward_length"] == cfg.moe_intermediate == 32
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_eps)
    # The embedded tokenizer's files give the tokenizer llama.cpp's converter wrote into the embedded GGUF.
    for key in TOKENIZER_KEYS:
        assert meta[key] == embedded_tokenizer[key], key
    assert meta["tokenizer.ggml.pre"] == "smollm" and len(meta["tokenizer.ggml.tokens"]) == 49152


def test_plain_folder_tensors_are_its_weights_in_llama_cpps_layout(plain):
    from margingate.models.fused_experts import split
    from margingate.models.gguf_export import LLAMA_CPP_ARCHS, read_tensor
    from margingate.models.gguf_names import ARCHS, gguf_name, permute
    from margingate.models.loader import load_config, load_state_dict

    folder, reader = plain
    cfg = load_config(folder)
    ours = split(cfg, load_state_dict(folder))
    if cfg.tie_embeddings:
        assert "output.weight" not in {t.name for t in reader.tensors}
        ours.pop("lm_head.weight", None)
    arch = LLAMA_CPP_ARCHS[cfg.architecture]
    assert sorted(t.name for t in reader.tensors) == sorted({gguf_name(k, arch) for k in ours})
    llama = ARCHS[arch].permuted  # llama.cpp's llama interleaves q/k rows; qwen2 and qwen3 do not
    for t in reader.tensors:
        # a mixture's experts stacked in expert order, one tensor per matrix
        want = torch.stack([ours[k] for k in ours if gguf_name(k, arch) == t.name]).squeeze(0)
        if llama and ".attn_q." in t.name:
            want = permute(want, cfg.num_heads)
        elif llama and ".attn_k." in t.name:
            want = permute(want, cfg.num_kv_heads)
        assert list(reversed(t.shape.tolist())) == list(want.shape), t.name  # GGUF lists dims innermost first
        f32 = want.dim() == 1 or t.name.endswith(".bias")  # gpt-oss's experts' biases: stacked, F32
        want_type = gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.BF16
        assert t.tensor_type == want_type, t.name
        assert torch.equal(read_tensor(t).reshape(want.shape), want.to(read_tensor(t).dtype)), t.name
    if cfg.attention_bias:  # written, and moved: the permutation is not the identity on them
        assert "blk.0.attn_q.bias" in {t.name for t in reader.tensors}
        if llama:
            assert not torch.equal(permute(ours["model.layers.0.self_attn.q_proj.bias"], cfg.num_heads),
                                   ours["model.layers.0.self_attn.q_proj.bias"])


def test_plain_folder_round_trips_through_our_gguf_importer(plain, tmp_path, monkeypatch):
    import dataclasses
    from pathlib import Path

    from margingate.models import gguf_import
    from margingate.models.fused_experts import split
    from margingate.models.loader import load_config, load_state_dict

    folder, reader = plain
    # The tokenizer is checked above, and slow to rebuild (the header itself is our quick walk).
    monkeypatch.setattr(gguf_import, "save_tokenizer", lambda path, out, reader: None)
    gguf_import.convert([Path(reader.data.filename)], tmp_path / "back")
    cfg, cfg_back = load_config(folder), load_config(tmp_path / "back")
    back, ours = load_state_dict(tmp_path / "back"), split(cfg, load_state_dict(folder))
    if cfg.tie_embeddings:
        ours.pop("lm_head.weight", None)
    assert set(back) == set(ours)
    for k in ours:
        assert torch.equal(back[k].view(torch.int16), ours[k].view(torch.int16)), k
    # Not compared as they are: attention_bias is no GGUF key (Llama's optional biases are just tensors),
    # and GGUF stores the norm epsilon as F32.
    assert cfg_back.rms_eps == pytest.approx(cfg.rms_eps, rel=1e-6)
    same = dataclasses.replace(cfg_back, name=cfg.name, attention_bias=cfg.attention_bias, rms_eps=cfg.rms_eps)
    assert same == cfg


def test_plain_folder_gguf_path_follows_its_weights(plain):
    import os

    from margingate.models.gguf_export import bf16_gguf_path

    folder, _ = plain
    first = bf16_gguf_path(folder)
    assert first.parent == folder.parent and first.name.startswith(folder.name + "-")
    weights = sorted(folder.glob("*.safetensors"))[0]
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same shape, rewritten weights
    try:
        assert bf16_gguf_path(folder) != first
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_what_llama_cpps_llama_cannot_run_is_refused_by_name(tmp_path):
    import json

    from margingate.models.gguf_export import write_bf16_gguf

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8}))
    with pytest.raises(ValueError, match="Gemma3ForCausalLM cannot be exported"):
        write_bf16_gguf(tmp_path, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_pre_tokenizer_names_are_llama_cpps():
    import json

    from margingate.models.gguf_tokenizer import pre_tokenizer

    def pre(text: str) -> dict:
        return {"pre_tokenizer": json.loads(text)}

    byte_level = '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": %s}'
    # As Qwen2's and Llama 3's tokenizer.json files spell their splits (JSON-escaped).
    qwen2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
             r"\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    llama3 = qwen2.replace(r"|\\p{N}|", r"|\\p{N}{1,3}|")
    split = '{"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "%s"}, ' \
            '"behavior": "Isolated", "invert": false}, ' + byte_level % "false" + "]}"
    smollm = '{"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, ' \
             + byte_level % "true" + "]}"
    assert pre_tokenizer(pre(smollm), ["a"]) == "smollm"
    assert pre_tokenizer(pre(byte_level % "true"), ["a"]) == "gpt-2"
    assert pre_tokenizer(pre(split % qwen2), ["a"]) == "qwen2"
    assert pre_tokenizer(pre(split % llama3), ["a"]) == "llama-bpe"
    with pytest.warns(UserWarning, match="default"):
        assert pre_tokenizer(pre(split % r"\\s+"), ["a"]) == "default"


def test_a_tokenizer_that_is_not_byte_level_bpe_is_refused(tmp_path):
    import json

    from margingate.models.gguf_tokenizer import add_tokenizer

    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "byte_fallback": True},
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}, "decoder": {"type": "Sequence"}}))
    with pytest.raises(ValueError, match="not a byte-level"):
        add_tokenizer(None, tmp_path, 1)


@pytest.mark.slow  # test_moe_grouped.py holds the MoE layer's bits in the default tier
def test_a_quantized_moe_gguf_runs_as_the_folder_quantized_at_load(model_dir, tmp_path, monkeypatch):
    """A mixture of experts written as a Q8_0 GGUF (experts stacked, as llama.cpp reads them) loads with
    its experts kept quantized, one GGUFMatrix per expert, and gives the tokens and logprobs of the folder
    quantized at load, bitwise. Control: the bf16 folder's logprobs differ. (Mixtral's stacked tensors
    round-trip above; its quantized Q/K rows take the Llama path test_quantize.py covers.)"""
    kind = "qwen3-moe"
    from margingate.llm import LLM
    from margingate.models import loader
    from margingate.models.gguf_export import write_gguf
    from margingate.options import SamplingParams

    folder = _hf_folder(kind, tmp_path / kind, model_dir)
    out = write_gguf(folder, tmp_path / f"{kind}.q8_0.gguf", quantize="q8_0")
    stacked = [t for t in gguf.GGUFReader(str(out)).tensors if t.name.endswith("_exps.weight")]
    assert stacked and all(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and t.shape[-1] == 4 for t in stacked)
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path / "cache")
    at_load, from_file, plain = (LLM(str(folder), quantize="q8_0", max_num_seqs=4), LLM(str(out), max_num_seqs=4),
                                 LLM(str(folder), max_num_seqs=4))
    assert from_file.environment()["weights"]["experts"] == at_load.environment()["weights"]["experts"] == "q8_0"
    prompts, params = ["The capital of France is", "1, 2, 3,"], SamplingParams(logprobs=2)

    def run(m, batch):
        policy = m.policy("reference")
        outs = m.generate(prompts, max_new_tokens=8, policy=policy, sampling=params) if batch else \
            [m.generate([p], max_new_tokens=8, policy=policy, sampling=params)[0] for p in prompts]
        return [(c.token_ids, c.logprobs) for c in outs]
    want = run(at_load, batch=False)
    assert run(from_file, batch=True) == run(from_file, batch=False) == want
    assert [lp for _, lp in run(plain, batch=False)] != [lp for _, lp in want]
