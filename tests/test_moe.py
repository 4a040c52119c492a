"""Mixture of experts (issue 46): Qwen3-MoE and Mixtral against transformers (fp32, tiny random models
from its config classes), a router whose choice is a function of the row alone, and bad shapes refused
by name at load."""
from __future__ import annotations

import pytest
import torch
from kv_helpers import request_pool

from margingate.kernels import layers
from margingate.kernels.choice import KernelChoice
from margingate.models import moe
from margingate.models.config import ModelConfig
from margingate.models.decoder import AttentionPlan, DecoderModel
from margingate.models.loader import load_config, load_state_dict, resolve_model_dir

tf = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, num_experts_per_tok=2)
KINDS = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(intermediate_size=96, moe_intermediate_size=32,
                                                                num_experts=4, head_dim=16, norm_topk_prob=True)),
    "qwen3-moe-dense-first": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=16,
                                   mlp_only_layers=[0])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=4)),
    # sinks, a sliding layer (window 8 of the 24 positions), YaRN, biases, the clamped SwiGLU (limit low enough
    # to clamp these activations)
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(intermediate_size=32, num_local_experts=4, head_dim=16,
                                                          sliding_window=8, swiglu_limit=0.3)),
}


def _hf_folder(kind: str, tmp_path):
    config_name, model_name, extra = KINDS[kind]
    torch.manual_seed(0)
    model = getattr(tf, model_name)(getattr(tf, config_name)(**SHAPE, **extra)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # q/k norms away from 1 so that they matter
                torch.nn.init.normal_(p, mean=1.0, std=0.3)
            elif name.endswith(("gate.weight", "router.weight")):  # a router sharp enough that its choice matters
                torch.nn.init.normal_(p, std=0.5)
            elif name.endswith(("sinks", "bias")):  # gpt-oss's start at or near 0
                torch.nn.init.normal_(p, std=1.0 if name.endswith("sinks") else 0.1)
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(tmp_path / kind)
    return model, resolve_model_dir(str(tmp_path / kind))


@pytest.mark.parametrize("kernel_choice", list(KernelChoice), ids=["invariant-kernels", "library-kernels"])
@pytest.mark.parametrize("kind", [k if k != "gpt-oss" else pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_moe_matches_transformers(kind, kernel_choice, tmp_path):
    hf, folder = _hf_folder(kind, tmp_path)
    config = load_config(folder)
    assert config.num_experts == 4 and config.experts_per_token == 2
    assert config.moe_layers == ((1,) if kind == "qwen3-moe-dense-first" else (0, 1))
    ours = DecoderModel(config, load_state_dict(folder, torch.bfloat16))
    tokens = torch.randint(0, SHAPE["vocab_size"], (24,), generator=torch.Generator().manual_seed(1))
    kv, tables = request_pool(config, 1, 32, torch.float32)
    logits = ours.forward(tokens, torch.arange(24), tables, torch.zeros(24, dtype=torch.long),
                          AttentionPlan.all_exact(24),
                          kv, dtype=torch.float32, kernel_choice=kernel_choice)
    with torch.no_grad():
        want = hf(tokens[None]).logits[0].float()
    assert (logits - want).abs().max() < 1e-4


def test_a_rows_experts_and_output_do_not_depend_on_the_other_rows(tmp_path):
    """bf16 rows through the block: each row alone, and the rows in shuffled batches, give the same bits."""
    _, folder = _hf_folder("qwen3-moe", tmp_path)
    config = load_config(folder)
    L = DecoderModel(config, load_state_dict(folder, torch.bfloat16)).own_weights.layers[0]
    x = (torch.randn(40, 64, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16)

    def block(rows):
        return moe.moe_mlp(rows, L, 2, True, layers.INVARIANT)

    together = block(x)
    for i in (0, 7, 39):
        assert torch.equal(block(x[i:i + 1])[0], together[i])
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
    assert torch.equal(block(x[perm]), together[perm])
    chosen = moe.route(torch.randn(40, 4), 2, True)[0]
    assert len({tuple(r) for r in chosen.tolist()}) > 2  # the rows do go to different experts


def test_ties_go_to_the_lower_expert_and_weights_are_normalized_in_order():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    experts, weights = moe.route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert weights[:, 0].tolist() == [0.5, 0.5] and weights.sum(-1).tolist() == [1.0, 1.0]
    unnormalized = moe.route(logits, 2, normalize=False)[1]
    assert unnormalized[1].tolist() == [0.25, 0.25]


def _raw(kind: str, **changes) -> dict:
    config_name, model_name, extra = KINDS[kind]
    raw = getattr(tf, config_name)(**SHAPE, **extra).to_dict()
    return {**raw, "architectures": [model_name], **changes}


@pytest.mark.parametrize("kind, changes, named", [
    ("qwen3-moe", {"num_experts": 0}, "needs at least one expert"),
    ("mixtral", {"num_local_experts": 0}, "needs at least one expert"),
    ("qwen3-moe", {"num_experts_per_tok": 5}, "num_experts_per_tok = 5 must lie in 1..4"),
    ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok = 0 must lie in 1..4"),
    ("qwen3-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step = 0"),
    ("qwen3-moe", {"rope_parameters": {"rope_type": "unheard-of", "rope_theta": 1e4}}, "'unheard-of'"),
    ("gpt-oss", {"num_local_experts": 0}, "needs at least one expert"),
    ("gpt-oss", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must name"),
    ("gpt-oss", {"sliding_window": None}, "need a sliding_window"),
    ("gpt-oss", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ("gpt-oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4'"),
    ("gpt-oss", {"rope_parameters": {"rope_type": "yarn", "factor": 0.5, "rope_theta": 1e4,
                                     "original_max_position_embeddings": 64}}, "needs factor > 1"),
])
def test_bad_moe_configs_are_named_errors_at_load(kind, changes, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(_raw(kind, **changes), "tiny")
