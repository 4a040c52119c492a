"""Gemma 3's forward against transformers' Gemma3ForCausalLM, on a small random-weight model saved
as a local Hugging Face folder: (1 + w) norms, embedding scale, q/k norms, the norms around both
residual branches, GELU-tanh, sliding-window and full layers with their two RoPE bases, and
query_pre_attn_scalar. Every norm weight is random so that each of them matters."""
from __future__ import annotations

import json

import pytest
import torch
from kv_helpers import request_pool

from margingate.kernels.choice import KernelChoice
from margingate.models import build_model
from margingate.models.architectures import GEMMA3_LAYER
from margingate.models.decoder import AttentionPlan
from margingate.models.loader import load_config, load_state_dict, resolve_model_dir

transformers = pytest.importorskip("transformers")

WINDOW = 8
# 7 layers: layer 5 is the full-attention one (every sixth), the others slide over 8 keys.
SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
             max_position_embeddings=128, rope_theta=1000.0)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(transformers' model in fp32, our model, the folder)."""
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SHAPE)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # initialised to 0 (a scale of 1): make every (1 + w) count
                torch.nn.init.normal_(p, std=0.3)
            p.copy_(p.to(torch.bfloat16).float())  # bf16-representable, as the engine holds weights
    folder = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    hf.save_pretrained(folder)
    folder = resolve_model_dir(str(folder))
    return hf, build_model(load_config(folder), load_state_dict(folder)), folder


def _run(model, tokens, plan=None, kv=None, start=0, slot=0, dtype=torch.float32,
         kernel_choice=KernelChoice.INVARIANT):
    cfg, n = model.config, tokens.shape[0]
    kv, tables = kv or request_pool(cfg, 2, 64, dtype)
    logits = model.forward(tokens, torch.arange(start, start + n), tables, torch.full((n,), slot), plan or
                           AttentionPlan.all_exact(n), kv, dtype=dtype, kernel_choice=kernel_choice)
    return logits, (kv, tables)  # the pool and its tables: a later call goes on where this one left off


def test_config_reads_gemma3(gemma):
    _, ours, folder = gemma
    cfg = ours.config
    assert ours.spec == GEMMA3_LAYER and ours.spec.sandwich_norms and ours.spec.activation == "gelu_tanh"
    assert cfg.layer_windows == (WINDOW,) * 5 + (0, WINDOW)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attention_scale) == (1000.0, 10000.0, 24 ** -0.5)


@pytest.mark.parametrize("kernel_choice", list(KernelChoice), ids=["invariant-kernels", "library-kernels"])
def test_gemma3_matches_transformers(gemma, kernel_choice):
    """fp32 activations over bf16 weights, through either kernel set: a 20-token prompt (past the
    8-key window) and one decode row (exact and batched attention) match transformers' fp32 logits."""
    hf, ours, _ = gemma
    tokens = torch.randint(0, SHAPE["vocab_size"], (20,), generator=torch.Generator().manual_seed(1))
    logits, kv = _run(ours, tokens, kernel_choice=kernel_choice)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0].float()
    assert (logits - expected).abs().max() < 1e-4
    nxt = torch.tensor([int(expected[-1].argmax())])
    with torch.no_grad():
        want = hf(torch.cat([tokens, nxt])[None]).logits[0, -1].float()
    for plan in (AttentionPlan(exact=[0]), AttentionPlan(batched=[0])):
        row, _ = _run(ours, nxt, plan, kv, start=20, kernel_choice=kernel_choice)
        assert (row[0] - want).abs().max() < 1e-4


def test_the_window_is_what_transformers_slides(gemma, tmp_path):
    """The same weights with a window wider than the prompt give other logits past 8 tokens, in both
    implementations alike: the comparison above would catch a window that is off by one or ignored."""
    hf, ours, folder = gemma
    tokens = torch.randint(0, SHAPE["vocab_size"], (20,), generator=torch.Generator().manual_seed(2))
    wide_dir = tmp_path / "wide"
    wide_dir.mkdir()
    for f in folder.iterdir():
        (wide_dir / f.name).symlink_to(f)
    raw = json.loads((folder / "config.json").read_text())
    (wide_dir / "config.json").unlink()
    (wide_dir / "config.json").write_text(json.dumps({**raw, "sliding_window": 64}))
    wide = build_model(load_config(wide_dir), load_state_dict(wide_dir))
    narrow_logits, _ = _run(ours, tokens)
    wide_logits, _ = _run(wide, tokens)
    assert torch.equal(narrow_logits[:WINDOW], wide_logits[:WINDOW])  # the window is not yet full
    assert (narrow_logits[WINDOW:] - wide_logits[WINDOW:]).abs().max() > 1e-2
    hf_wide = transformers.Gemma3ForCausalLM.from_pretrained(wide_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (wide_logits - hf_wide(tokens[None]).logits[0]).abs().max() < 1e-4


def test_bf16_rows_are_batch_invariant(gemma):
    """bf16 through our kernels: a prompt's logits alone equal its logits beside another request's rows
    in one forward, and a decode row's alone equal its logits in a batch of decode rows, bitwise."""
    _, ours, _ = gemma
    cfg = ours.config
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 300, (19,), generator=g), torch.randint(0, 300, (13,), generator=g)
    alone, _ = _run(ours, a, dtype=torch.bfloat16)
    kv, tables = request_pool(cfg, 2, 64, torch.bfloat16)
    both = ours.forward(torch.cat([b, a]), torch.cat([torch.arange(13), torch.arange(19)]), tables,
                        torch.cat([torch.zeros(13, dtype=torch.long), torch.ones(19, dtype=torch.long)]),
                        AttentionPlan.all_exact(32), kv, dtype=torch.bfloat16)
    assert torch.equal(both[13:], alone)
    step = ours.forward(torch.tensor([5, 7]), torch.tensor([13, 19]), tables, torch.tensor([0, 1]),
                        AttentionPlan.all_exact(2), kv, dtype=torch.bfloat16)
    _, kv_a = _run(ours, a, dtype=torch.bfloat16, slot=1)
    one, _ = _run(ours, torch.tensor([7]), kv=kv_a, start=19, slot=1, dtype=torch.bfloat16)
    assert torch.equal(step[1:], one)


@pytest.mark.parametrize("key, value, message", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping = 30.0 is not supported"),
    ("hidden_activation", "relu", "hidden_activation 'relu' is not supported"),
    ("layer_types", ["full_attention"], "layer_types must name full_attention or sliding_attention"),
    ("rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "linear RoPE scaling"),
])
def test_unsupported_gemma3_configs_are_refused_by_name(gemma, tmp_path, key, value, message):
    _, _, folder = gemma
    raw = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path)


def test_compiled_stack_equals_the_layer_by_layer_forward(gemma):
    """Gemma's layer in the one-call compiled stack (q/k norms, post norms, GELU-tanh, both RoPE
    tables, sliding windows crossed) gives the Python path's bits: logits and every K/V column,
    for prompt rows of three requests (up to 30 positions, past the 8-key window) and a batched
    decode step."""
    from test_model_family import assert_stack_equals_layers

    assert_stack_equals_layers(gemma[1], SHAPE["vocab_size"], seed=4)
