"""The Llama-family forward (Llama, Mistral, Qwen2 with q/k/v bias, Llama with attention_bias, Qwen3 with
its q/k norms)
against transformers, on small random-weight models saved as local Hugging Face folders (exact
control, fast); and the weight name map: missing, stray and misshapen tensors refused by name,
tied embeddings, attention biases as the config says."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from kv_helpers import request_pool
from safetensors.torch import load_file, save_file

from margingate.kernels.choice import KernelChoice
from margingate.models.decoder import AttentionPlan, DecoderModel
from margingate.models.loader import load_config, load_state_dict, resolve_model_dir
from margingate.models.weights import WeightsError

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _hf_model(kind: str, tmp_path):
    import transformers as tf

    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "llama-bias": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                             "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[kind]
    torch.manual_seed(0)
    extra = {"llama-bias": {"attention_bias": True}, "qwen3": {"head_dim": 16}}.get(kind, {})
    tied = kind in ("qwen2", "llama-tied")
    model = model_cls(config_cls(**SHAPE, tie_word_embeddings=tied, **extra)).float().eval()
    with torch.no_grad():
        if kind in ("qwen2", "llama-bias"):  # make the biases matter (q/k/v; Llama's o_proj too)
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                    if proj.bias is not None:
                        torch.nn.init.normal_(proj.bias, std=0.5)
        if kind == "qwen3":  # q/k norms away from their initial ones, so that they matter
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.5)
        for p in model.parameters():  # bf16-representable, as the engine holds weights
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


@pytest.mark.parametrize("kernel_choice", list(KernelChoice), ids=["invariant-kernels", "library-kernels"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "llama-bias", "qwen3"])
def test_family_matches_transformers(kind, kernel_choice, tmp_path):
    """fp32 activations over bf16 weights, through either kernel set: a 20-token prompt and one
    decode row (exact and batched attention) match transformers' fp32 logits within 1e-4."""
    hf, folder = _hf_model(kind, tmp_path)
    folder = resolve_model_dir(str(folder))
    config = load_config(folder)
    assert config.attention_bias == (kind in ("qwen2", "llama-bias"))
    ours = DecoderModel(config, load_state_dict(folder, torch.bfloat16))
    tokens = torch.randint(0, SHAPE["vocab_size"], (20,))
    kv, tables = request_pool(config, 2, 64, torch.float32)
    logits = ours.forward(tokens, torch.arange(20), tables, torch.zeros(20, dtype=torch.long),
                          AttentionPlan.all_exact(20),
                          kv, dtype=torch.float32, kernel_choice=kernel_choice)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0].float()
    assert (logits - expected).abs().max() < 1e-4
    nxt = torch.tensor([int(expected[-1].argmax())])
    for plan in (AttentionPlan(exact=[0]),
                 AttentionPlan(batched=[0])):
        row = ours.forward(nxt, torch.tensor([20]), tables, torch.zeros(1, dtype=torch.long), plan, kv,
                           dtype=torch.float32,
                           kernel_choice=kernel_choice)
        with torch.no_grad():
            want = hf(torch.cat([tokens, nxt])[None]).logits[0, -1].float()
        assert (row[0] - want).abs().max() < 1e-4


# --- the weight name map -------------------------------------------------------------------------


def _variant(folder, dest, drop=(), add=None, config=None):
    """A copy of model folder `folder` at `dest` without the tensors `drop`, with `add`, and with
    `config` merged into its config.json."""
    shutil.copytree(folder, dest)
    state = load_file(str(dest / "model.safetensors"))
    for name in drop:
        del state[name]
    state.update(add or {})
    save_file(state, str(dest / "model.safetensors"))
    raw = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**raw, **(config or {})}))
    return dest


def _load(folder):
    return DecoderModel(load_config(folder), load_state_dict(folder))


def _logits(model, tokens):
    cfg = model.config
    kv, tables = request_pool(cfg, 1, 32, torch.bfloat16)
    n = tokens.shape[0]
    return model.forward(tokens, torch.arange(n), tables, torch.zeros(n, dtype=torch.long),
                         AttentionPlan.all_exact(n), kv)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                  "model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"])
def test_missing_weight_is_named(name, tmp_path):
    """A folder without one of the model's tensors is refused with that tensor's name and the
    folder (a WeightsError, a ValueError), never a KeyError from deep inside the model."""
    _, folder = _hf_model("llama", tmp_path)
    broken = _variant(folder, tmp_path / "broken", drop=[name])
    with pytest.raises(WeightsError, match=re.escape(f"{name} missing in {broken}")) as err:
        _load(broken)
    assert isinstance(err.value, ValueError) and not isinstance(err.value, KeyError)
    if name == "lm_head.weight":  # an untied model needs its own head
        assert "tie_word_embeddings is false" in str(err.value)


def test_stray_and_misshapen_weights_are_named(tmp_path):
    """A tensor the architecture has no place for, or one whose shape disagrees with config.json,
    is refused by name; buffers old checkpoints carry (rotary inv_freq) are read past."""
    _, folder = _hf_model("llama", tmp_path)
    stray = _variant(folder, tmp_path / "stray", add={"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)})
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.gate_proj\.bias in .* is not a weight"):
        _load(stray)
    wrong = torch.zeros(64, 63)
    bad = _variant(folder, tmp_path / "bad", add={"model.layers.1.self_attn.o_proj.weight": wrong})
    with pytest.raises(WeightsError, match=r"o_proj\.weight in .* has shape \[64, 63\]; config.json implies \[64, 64"):
        _load(bad)
    old = _variant(folder, tmp_path / "old", add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    assert torch.equal(_logits(_load(old), torch.arange(9)), _logits(_load(folder), torch.arange(9)))


def test_tied_embeddings(tmp_path):
    """tie_word_embeddings: the folder has no lm_head.weight, the model loads, and its head is the
    embedding matrix: its logits equal, bitwise, those of an untied copy whose lm_head.weight is the
    embedding, and differ from an untied copy with another head. A stray lm_head.weight in a tied
    folder is not read (transformers ties over it too)."""
    _, folder = _hf_model("llama-tied", tmp_path)
    config = load_config(folder)
    assert config.tie_embeddings and "lm_head.weight" not in load_state_dict(folder)
    tied = _load(folder)
    w = tied.weights(torch.bfloat16)
    assert w.lm_head is w.embed and tied.weights(torch.float32).tied
    embed = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    untied = _variant(folder, tmp_path / "untied", add={"lm_head.weight": embed.clone()},
                      config={"tie_word_embeddings": False})
    other = _variant(folder, tmp_path / "other", add={"lm_head.weight": torch.randn_like(embed)},
                     config={"tie_word_embeddings": False})
    stray = _variant(folder, tmp_path / "stray", add={"lm_head.weight": torch.randn_like(embed)})
    tokens = torch.arange(0, 200, 13)
    logits = _logits(tied, tokens)
    assert torch.equal(logits, _logits(_load(untied), tokens))
    assert not torch.equal(logits, _logits(_load(other), tokens))
    assert torch.equal(logits, _logits(_load(stray), tokens))


def test_attention_bias_respected(tmp_path):
    """attention_bias decides which biases the model needs: Llama with it true needs q/k/v/o
    biases (one missing is refused by name) and uses them (zeroing one changes the logits);
    with it false a bias is a stray tensor. Qwen2 has q/k/v biases whatever its config says,
    Mistral none."""
    _, folder = _hf_model("llama-bias", tmp_path)
    assert load_config(folder).attention_bias
    name = "model.layers.1.self_attn.o_proj.bias"
    missing = _variant(folder, tmp_path / "missing", drop=[name])
    with pytest.raises(WeightsError, match=re.escape(f"{name} missing in {missing}") + ".*attention_bias is true"):
        _load(missing)
    zeroed = _variant(folder, tmp_path / "zeroed", add={name: torch.zeros(SHAPE["hidden_size"])})
    tokens = torch.arange(0, 200, 13)
    assert not torch.equal(_logits(_load(folder), tokens), _logits(_load(zeroed), tokens))
    off = _variant(folder, tmp_path / "off", config={"attention_bias": False})
    with pytest.raises(WeightsError, match=r"self_attn\.\w_proj\.bias in .* is not a weight.*attention_bias is false"):
        _load(off)

    _, qwen = _hf_model("qwen2", tmp_path)
    assert load_config(_variant(qwen, tmp_path / "qwen-off", config={"attention_bias": False})).attention_bias
    no_bias = _variant(qwen, tmp_path / "qwen-no-bias", drop=["model.layers.0.self_attn.k_proj.bias"])
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias missing"):
        _load(no_bias)
    _, mistral = _hf_model("mistral", tmp_path)
    assert not load_config(_variant(mistral, tmp_path / "mistral-on", config={"attention_bias": True})).attention_bias


def _fused_and_layered(model: DecoderModel, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       decode: torch.Tensor, kv_dtype: str = "bfloat16"):
    """The same bf16 forwards through the one-call compiled stack and through the layer-by-layer
    Python path, each into its own cache: a prefill whose rows attend exactly, then one decode
    row per slot attending as a padded batch. (logits of both forwards, K and V, their int8 scales) of each
    path."""
    results = []
    for fused in (True, False):
        model.fused = fused
        cfg = model.config
        kv, tables = request_pool(cfg, 3, 64, kv_dtype)
        prompt = model.forward(tokens, positions, tables, slots, AttentionPlan.all_exact(len(tokens)), kv)
        ends = torch.tensor([int(positions[slots == s].max()) + 1 for s in range(3)])
        step = model.forward(decode, ends, tables, torch.arange(3), AttentionPlan(batched=[0, 1, 2]), kv)
        results.append((torch.cat((prompt, step)), torch.cat([t.flatten().float() for t in kv.tensors()[:2]]),
                        torch.cat([t.flatten() for t in kv.tensors()[2:]])))
    model.fused = True
    return results


def assert_stack_equals_layers(model: DecoderModel, vocab_size: int, seed: int, kv_dtype: str = "bfloat16") -> None:
    """`_fused_and_layered` on prompt rows of three requests at mixed positions (30, 10 and 20 tokens) and a
    batched decode step: logits and every K/V column (int8: codes and scales) equal, bitwise, and not all zero."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (60,), generator=g)
    positions = torch.cat((torch.arange(30), torch.arange(10), torch.arange(20)))
    slots = torch.tensor([2] * 30 + [0] * 10 + [1] * 20)
    decode = torch.randint(0, vocab_size, (3,), generator=g)
    (lf, kvf, sf), (ll, kvl, sl) = _fused_and_layered(model, tokens, positions, slots, decode, kv_dtype)
    assert lf.abs().sum() > 0 and kvf.abs().sum() > 0 and (kv_dtype == "bfloat16" or sf.abs().sum() > 0)
    assert torch.equal(lf, ll) and torch.equal(kvf, kvl) and torch.equal(sf, sl)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-bias", "qwen3"])
def test_compiled_stack_equals_the_layer_by_layer_forward(kind, tmp_path):
    """The whole decoder stack in one compiled call (RoPE, K/V writes and residual adds done in
    C++) gives the Python path's bits: logits and every K/V column, with and without biases,
    for prompt rows of three requests at mixed positions and a batched decode step."""
    _, folder = _hf_model(kind, tmp_path)
    assert_stack_equals_layers(_load(folder), SHAPE["vocab_size"], seed=1)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_compiled_stack_equals_the_layer_by_layer_forward_over_a_quantized_cache(tmp_path, kv_dtype):
    """With an int8 or int4 KV cache both paths rotate and quantize each K/V row with the same compiled store and
    read it back with the same kernel (the stack passing the pool's rotation as the layer does): the same logits,
    codes and scales, bit for bit."""
    _, folder = _hf_model("qwen3", tmp_path)
    assert_stack_equals_layers(_load(folder), SHAPE["vocab_size"], seed=2, kv_dtype=kv_dtype)
