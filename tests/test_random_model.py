"""scripts/make_random_model.py: random Llama folders of real Llama shapes that our loader reads.

Written at the script's test-only `tiny` size (hidden 256, 2 layers); the 1b/8b shapes are checked
against the published Llama parameter counts without writing them."""
from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture
def script(random_model_script):
    return random_model_script


@pytest.fixture
def tiny(tiny_random_model):
    """The session's `tiny` folder (seed 3, written once: conftest.py)."""
    return tiny_random_model


def _base(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_shapes_are_llamas(script, model_dir):
    # Per-layer parameters of Llama 3.2 1B and Llama 3 8B (GQA with 8 KV heads), and the shards' sizes.
    for size, per_layer, layers, n_shards in (("1b", 60_821_504, 16, 2), ("8b", 218_112_000, 32, 8)):
        cfg = script.config(size, _base(model_dir))
        plan = script.tensors(cfg)
        numel = {name: torch.Size(shape).numel() for name, shape in plan}
        assert sum(n for k, n in numel.items() if k.startswith("model.layers.0.")) == per_layer, size
        assert sum(k.startswith("model.layers.") for k in numel) == 9 * layers
        assert numel["lm_head.weight"] == numel["model.embed_tokens.weight"] == 49152 * cfg["hidden_size"]
        groups = script.shards(plan)
        assert len(groups) == n_shards, size
        assert all(sum(2 * numel[n] for n, _ in g) <= script.SHARD_BYTES for g in groups)
        assert [n for g in groups for n, _ in g] == [n for n, _ in plan]  # in order, each once


def test_folder_is_a_llama_with_the_embedded_tokenizer(tiny, model_dir, script):
    from margingate.models.loader import load_config, load_state_dict

    cfg = load_config(tiny)
    base = _base(model_dir)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "LlamaForCausalLM", 256, 2, 4, 2)
    assert not cfg.tie_embeddings and cfg.vocab_size == base["vocab_size"] == 49152
    assert (cfg.rope_theta, cfg.eos_token_ids) == (base["rope_theta"], (base["eos_token_id"],))
    assert (tiny / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    state = load_state_dict(tiny)
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    assert torch.equal(state["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    w = state["model.layers.1.mlp.down_proj.weight"].float()
    assert abs(w.std().item() - script.STD) < 0.001 and abs(w.mean().item()) < 0.001
    script.verify(tiny)  # names and shapes are what the loader's map wants


def test_same_seed_same_weights_whatever_the_sharding(tiny, script, tmp_path):
    from margingate.models.loader import load_state_dict

    cfg = json.loads((tiny / "config.json").read_text())
    files = script.write(tmp_path, cfg, seed=3, progress=False, shard_bytes=10 * 2**20)
    assert len(files) > 2 and not (tiny / "model.safetensors.index.json").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    one, sharded = load_state_dict(tiny), load_state_dict(tmp_path)
    assert set(index["weight_map"]) == set(sharded) == set(one)
    assert all(torch.equal(one[k], sharded[k]) for k in one)
    other = tmp_path / "seed4"
    other.mkdir()
    script.write(other, cfg, seed=4, progress=False)
    assert not torch.equal(load_state_dict(other)["lm_head.weight"], one["lm_head.weight"])


def test_refuses_a_non_empty_folder_unless_forced(tiny, script, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    with pytest.raises(SystemExit, match="--force"):
        script.make("tiny", out, progress=False)
    script.make("tiny", out, seed=3, force=True, progress=False)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]  # the stale shard is gone
    assert (out / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


def test_generates_through_the_facade(tiny):
    from transformers import AutoModelForCausalLM

    from margingate.data.prompts import Prompt
    from margingate.llm import LLM

    llm = LLM(str(tiny), max_num_seqs=2, max_model_len=64)
    assert llm.config.num_layers == 2 and llm.config.hidden_size == 256
    prompts = [Prompt("text", None, "The capital of France is", "test"), Prompt("text", None, "1 2 3", "test")]
    out = llm.generate(prompts, max_new_tokens=3, ignore_eos=True)
    assert [len(c.token_ids) for c in out] == [3, 3]
    # transformers reads the same folder: our first token is among its top 3 (random weights leave
    # near-ties, so not always its argmax; weights read wrongly would land anywhere in 49152).
    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    for p, c in zip(prompts, out):
        ids = torch.tensor([llm.tokenizer.encode_prompt(p)])
        with torch.inference_mode():
            top = hf(ids).logits[0, -1].topk(3).indices.tolist()
        assert c.token_ids[0] in top, (p.text, c.token_ids, top)


def test_moe_shapes_are_qwen3_moes_that_load(script, model_dir, tmp_path):
    """moe-tiny is written and read as a Qwen3-MoE (its router and experts where the loader's map wants
    them); moe-a1b has Qwen3-30B-A3B's expert width, top-8 and attention, at 16 layers of 64 experts."""
    from margingate.models.loader import load_config

    folder = script.make("moe-tiny", tmp_path / "moe", seed=1, progress=False)
    cfg = load_config(folder)
    assert (cfg.architecture, cfg.num_experts, cfg.experts_per_token, cfg.moe_layers) == (
        "Qwen3MoeForCausalLM", 8, 2, (0, 1))
    script.verify(folder)
    big = script.config("moe-a1b", _base(model_dir))
    plan = dict(script.tensors(big))
    assert plan["model.layers.15.mlp.experts.63.down_proj.weight"] == (2048, 768)
    assert plan["model.layers.0.mlp.gate.weight"] == (64, 2048) and big["num_experts_per_tok"] == 8
    per_layer = sum(torch.Size(s).numel() for n, s in plan.items() if n.startswith("model.layers.0."))
    attention, norms = 2048 * (4096 + 2 * 512 + 4096), 2 * 2048 + 2 * 128  # q, k, v, o; two norms, q/k norms
    assert per_layer == 64 * 3 * 2048 * 768 + 64 * 2048 + attention + norms
