"""The Llama-family forward (Llama, Mistral, Qwen2 with q/k/v bias) against transformers,
on small random-weight models saved as local Hugging Face folders (exact control, fast)."""
from __future__ import annotations

import pytest
import torch

from margingate.kv_cache import KVCache
from margingate.models.llama import AttentionPlan, LlamaModel
from margingate.models.loader import load_config, load_state_dict, resolve_model_dir

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _hf_model(kind: str, tmp_path):
    import transformers as tf

    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, tie_word_embeddings=(kind == "qwen2"))).float().eval()
    with torch.no_grad():
        if kind == "qwen2":  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
        for p in model.parameters():  # bf16-representable, as the engine holds weights
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant-kernels", "library-kernels"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_family_matches_transformers(kind, invariant, tmp_path):
    """fp32 activations over bf16 weights, through either kernel set: a 20-token prompt and one
    decode row (exact and batched attention) match transformers' fp32 logits within 1e-4."""
    hf, folder = _hf_model(kind, tmp_path)
    folder = resolve_model_dir(str(folder))
    config = load_config(folder)
    assert config.attention_bias == (kind == "qwen2")
    ours = LlamaModel(config, load_state_dict(folder, torch.bfloat16))
    tokens = torch.randint(0, SHAPE["vocab_size"], (20,))
    kv = KVCache(config.num_layers, 2, 64, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    logits = ours.forward(tokens, torch.arange(20), torch.zeros(20, dtype=torch.long), AttentionPlan.all_exact(20),
                          kv, dtype=torch.float32, invariant=invariant)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0].float()
    assert (logits - expected).abs().max() < 1e-4
    nxt = torch.tensor([int(expected[-1].argmax())])
    for plan in (AttentionPlan(exact=[0]), AttentionPlan(batched=[0])):
        row = ours.forward(nxt, torch.tensor([20]), torch.zeros(1, dtype=torch.long), plan, kv, dtype=torch.float32,
                           invariant=invariant)
        with torch.no_grad():
            want = hf(torch.cat([tokens, nxt])[None]).logits[0, -1].float()
        assert (row[0] - want).abs().max() < 1e-4
