"""Issue 46's table: our `reference` logprobs (fp32 activations over bf16 weights, the invariant kernels)
against transformers' fp32 forward of the same tiny random model, per architecture; plain Llama is the
control, and the llama3-RoPE row compares positions 1,000-1,100 with transformers' scaled and unscaled
forwards.

    .venv/bin/python results/models/hf-compare/compare.py   # writes table.md and table.json beside it
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers as tf

from margingate.models import build_model
from margingate.models.decoder import AttentionPlan
from margingate.models.kv_cache import KVPool
from margingate.models.loader import load_config, load_state_dict, resolve_model_dir

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
KINDS = {  # name: (config class, model class, config fields, positions)
    "Llama (control)": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=128), 64),
    "Mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=128), 64),
    "Qwen2 (q/k/v bias)": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=128), 64),
    "Qwen3 (q/k norms)": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=128, head_dim=16), 64),
    "Qwen3-MoE (4 experts, top 2)": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                     dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                          num_experts_per_tok=2, head_dim=16, norm_topk_prob=True), 64),
    "Mixtral (4 experts, top 2)": ("MixtralConfig", "MixtralForCausalLM",
                                   dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), 64),
    "Llama, llama3 RoPE (positions 1000-1100)": ("LlamaConfig", "LlamaForCausalLM",
                                                 dict(intermediate_size=128, rope_scaling=LLAMA3), 1100),
}


def hf_model(config_name: str, model_name: str, fields: dict, positions: int):
    torch.manual_seed(0)
    cfg = getattr(tf, config_name)(**BASE, **fields, max_position_embeddings=max(256, 2 * positions))
    model = getattr(tf, model_name)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, mean=1.0, std=0.3)
            elif "gate.weight" in name:
                torch.nn.init.normal_(p, std=0.5)
            else:
                p.mul_(4)  # sharper attention and logits: differences show
            p.copy_(p.to(torch.bfloat16).float())
    return model


def logprobs(model, folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config = load_config(folder)
    ours = build_model(config, load_state_dict(folder, torch.bfloat16))
    n = tokens.shape[0]
    kv = KVPool(config.num_layers, -(-n // 16), 16, config.num_kv_heads, config.head_dim, "float32")
    tables = kv.tables_for(1, n)
    got = ours.forward(tokens, torch.arange(n), tables, torch.zeros(n, dtype=torch.long), AttentionPlan.all_exact(n),
                       kv,
                       dtype=torch.float32)
    with torch.no_grad():
        want = model(tokens[None]).logits[0].float()
    return torch.log_softmax(got.float(), -1), torch.log_softmax(want, -1)


def main() -> None:
    rows, out = [], Path(__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config_name, model_name, fields, positions) in KINDS.items():
            model = hf_model(config_name, model_name, fields, positions)
            folder = Path(tmp) / model_name
            model.save_pretrained(folder)
            tokens = torch.randint(0, 256, (positions,), generator=torch.Generator().manual_seed(1))
            ours, theirs = logprobs(model, resolve_model_dir(str(folder)), tokens)
            tail = slice(1000, positions) if positions > 1000 else slice(0, positions)
            diff = (ours[tail] - theirs[tail]).abs()
            row = {"model": name, "positions": f"{tail.start}-{tail.stop}", "mean": diff.mean().item(),
                   "max": diff.max().item()}
            if "rope_scaling" in fields:
                plain = hf_model(config_name, model_name, {k: v for k, v in fields.items() if k != "rope_scaling"},
                                 positions)
                with torch.no_grad():
                    unscaled = torch.log_softmax(plain(tokens[None]).logits[0].float(), -1)
                row["mean vs unscaled"] = (ours[tail] - unscaled[tail]).abs().mean().item()
            rows.append(row)
            print(row, file=sys.stderr)
    lines = ["| model | positions | mean abs logprob diff | max | mean vs transformers unscaled |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['positions']} | {r['mean']:.2e} | {r['max']:.2e} | "
              f"{r['mean vs unscaled']:.2e} |" if "mean vs unscaled" in r else
              f"| {r['model']} | {r['positions']} | {r['mean']:.2e} | {r['max']:.2e} | - |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "table.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
