"""Every config field that changes the forward is implemented or refused by name (issue 46).

transformers (fp32, tiny random models from its config classes) is the oracle: Llama 3's RoPE scaling
matches its scaled forward at positions past 1,000 and not its unscaled one; a GGUF's `rope_freqs`
tensor gives the same scaling; every key transformers' configs of our architectures hold is one the
config reader uses, knows to have no effect on the forward, or refuses unless it is off."""
from __future__ import annotations

import json

import pytest
import torch
from kv_helpers import request_pool

from margingate.models import config as config_module
from margingate.models import rope_scaling
from margingate.models.config import ModelConfig
from margingate.models.decoder import AttentionPlan, DecoderModel
from margingate.models.loader import load_config, load_state_dict, resolve_model_dir

tf = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LENGTH = 1100  # positions 1,000+ (16x the original context): where the scaling moves every long wavelength


def _hf_pair(tmp_path):
    """One set of random weights as transformers' fp32 Llama with llama3 scaling and without; the scaled
    one saved as a folder. Weights x4 (bf16-representable): attention sharp enough for RoPE to matter."""
    torch.manual_seed(0)
    scaled = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, rope_scaling=LLAMA3)).float().eval()
    with torch.no_grad():
        for p in scaled.parameters():
            p.copy_((p * 4).to(torch.bfloat16).float())
    plain = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)).float().eval()
    plain.load_state_dict(scaled.state_dict())
    scaled.save_pretrained(tmp_path / "llama3")
    return scaled, plain, tmp_path / "llama3"


def _our_logprobs(folder, tokens, **config_changes) -> torch.Tensor:
    config = load_config(folder)
    if config_changes:
        config = ModelConfig(**{**{f: getattr(config, f) for f in config.__slots__}, **config_changes})
    model = DecoderModel(config, load_state_dict(folder, torch.bfloat16))
    n = tokens.shape[0]
    kv, tables = request_pool(config, 1, n, torch.float32)
    logits = model.forward(tokens, torch.arange(n), tables, torch.zeros(n, dtype=torch.long),
                           AttentionPlan.all_exact(n),
                           kv, dtype=torch.float32)
    return torch.log_softmax(logits.float(), -1)


def test_llama3_rope_scaling_follows_transformers_scaled_forward(tmp_path):
    scaled, plain, folder = _hf_pair(tmp_path)
    config = load_config(resolve_model_dir(str(folder)))
    assert config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64.0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (LENGTH,), generator=torch.Generator().manual_seed(1))
    ours = _our_logprobs(folder, tokens)
    with torch.no_grad():
        want = torch.log_softmax(scaled(tokens[None]).logits[0].float(), -1)
        unscaled = torch.log_softmax(plain(tokens[None]).logits[0].float(), -1)
    late = slice(1000, LENGTH)
    near, far = (ours[late] - want[late]).abs(), (ours[late] - unscaled[late]).abs()
    assert near.max() < 2e-3, near.max()  # fp32 activations over the same bf16 weights
    assert far.mean() > 50 * near.mean(), (far.mean(), near.mean())


def test_a_gguf_rope_freqs_tensor_scales_as_llama3_does(tmp_path):
    """llama.cpp's form (one divisor per frequency, as its converter writes rope_freqs) gives logprobs
    near the llama3 parameters' own (a medium frequency's divisor moves its inverse by an ulp, an angle
    at position 1,000 by about 1e-4) and far from plain RoPE's."""
    _, _, folder = _hf_pair(tmp_path)
    config = load_config(resolve_model_dir(str(folder)))
    plain = rope_scaling.inv_freq(config.head_dim, config.rope_theta)
    factors = tuple((plain / rope_scaling.inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)).tolist())
    tokens = torch.randint(0, SHAPE["vocab_size"], (LENGTH,), generator=torch.Generator().manual_seed(2))
    by_params = _our_logprobs(folder, tokens)
    by_factors = _our_logprobs(folder, tokens, rope_scaling=(), rope_freq_factors=factors)
    unscaled = _our_logprobs(folder, tokens, rope_scaling=())
    near, far = (by_params - by_factors).abs(), (by_params - unscaled).abs()
    assert near.max() < 5e-3 and far.mean() > 50 * near.mean(), (near.max(), near.mean(), far.mean())


def test_linear_rope_scaling_follows_transformers(tmp_path):
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 4.0})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_((p * 4).to(torch.bfloat16).float())
    hf.save_pretrained(tmp_path / "linear")
    tokens = torch.randint(0, SHAPE["vocab_size"], (300,), generator=torch.Generator().manual_seed(3))
    ours = _our_logprobs(resolve_model_dir(str(tmp_path / "linear")), tokens)
    with torch.no_grad():
        want = torch.log_softmax(hf(tokens[None]).logits[0].float(), -1)
    assert (ours - want).abs().max() < 2e-3


def _raw(**changes) -> dict:
    raw = tf.LlamaConfig(**SHAPE).to_dict()
    raw["architectures"] = ["LlamaForCausalLM"]
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes, named", [
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
     "RoPE scaling of type 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn RoPE scaling needs numeric"),
    ({"rope_parameters": {"rope_type": "made-up", "rope_theta": 1e4}}, "RoPE scaling of type 'made-up'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE scaling of type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3 RoPE scaling needs numeric"),
    ({"rope_parameters": {**LLAMA3, "factor": 0.0}}, "factor must be > 0"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias = True"),
    ({"model_type": "mistral", "sliding_window": 512}, "sliding_window = 512"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window = True"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
])
def test_a_field_that_changes_the_forward_and_is_not_implemented_is_refused_by_name(changes, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        ModelConfig.from_hf(_raw(**changes), "tiny")


def test_fields_at_their_off_values_load():
    assert ModelConfig.from_hf(_raw(mlp_bias=False, hidden_act="silu"), "tiny").rope_scaling == ()
    qwen = tf.Qwen2Config(**SHAPE).to_dict()  # sliding_window set, use_sliding_window off: full attention
    assert ModelConfig.from_hf({**qwen, "architectures": ["Qwen2ForCausalLM"]}, "tiny").layer_windows == ()


@pytest.mark.parametrize("config_class", ["LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config",
                                          "Qwen3MoeConfig", "MixtralConfig", "Gemma3TextConfig", "GptOssConfig"])
def test_every_key_of_transformers_configs_is_used_refused_or_known_to_leave_the_forward_alone(config_class):
    """A transformers release that adds a field fails here until the field is sorted into one of them."""
    keys = set(getattr(tf, config_class)(**SHAPE, rope_scaling=LLAMA3 if config_class == "LlamaConfig" else None)
               .to_dict())
    unsorted = keys - config_module.READ - config_module.NO_FORWARD - config_module.REFUSED
    assert not unsorted, f"{config_class} fields neither read, refused nor known to leave the forward alone: {unsorted}"


def test_the_rope_scaling_of_a_folder_reaches_its_fingerprint(tmp_path):
    _, _, folder = _hf_pair(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    scaled = ModelConfig.from_hf(raw, "x")
    plain = ModelConfig.from_hf({k: v for k, v in raw.items() if k not in ("rope_scaling", "rope_parameters")}, "x")
    assert scaled.fingerprint() != plain.fingerprint()


def test_a_gguf_states_its_rope_scaling_in_config_json():
    """rope_freqs becomes config.json's rope_freq_factors; a linear scaling type its rope_scaling; another
    type is passed on under its own name, which the config reader then refuses."""
    from types import SimpleNamespace

    import numpy as np

    from margingate.models.gguf_import import ROPE_FREQS, rope_config

    freqs = SimpleNamespace(name=ROPE_FREQS, dequantized=lambda: np.array([1.0, 1.0, 2.5, 8.0], dtype=np.float32))
    reader = SimpleNamespace(tensors=[SimpleNamespace(name="token_embd.weight"), freqs])
    assert rope_config(lambda key, default=None: default, reader) == {"rope_freq_factors": [1.0, 1.0, 2.5, 8.0]}
    meta = {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}
    plain = SimpleNamespace(tensors=[])
    linear = rope_config(lambda k, d=None: meta.get(k, d), plain)
    assert linear == {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    longrope = rope_config(lambda k, d=None: {"rope.scaling.type": "longrope"}.get(k, d), plain)
    with pytest.raises(ValueError, match="RoPE scaling of type 'longrope'"):
        ModelConfig.from_hf(_raw(**longrope), "a longrope gguf")


def test_the_gguf_export_refuses_a_scaled_rope_by_name(tmp_path):
    from margingate.models.gguf_export import write_bf16_gguf

    _, _, folder = _hf_pair(tmp_path)
    with pytest.raises(ValueError, match="RoPE scaling \\(llama3\\) is not written"):
        write_bf16_gguf(resolve_model_dir(str(folder)), tmp_path / "out.gguf")
