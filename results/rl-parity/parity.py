"""The parity table: architecture x policy x sampling -> sampled tokens whose trainer logprob differs from the
rollout's, out of all.

    python results/rl-parity/parity.py --out results/rl-parity                   # embedded model + tiny ones
    python results/rl-parity/parity.py --models qwen2.5-coder-0.5b --out ...     # a real model (`make models`)

Per (model, policy, sampling): 64 prompts (or --rollouts) of mixed lengths, sampled in engine batches of 1, 2, 4,
8, 16, 16, 16, 1 rollouts, each batch beside 4 unprotected (`fast`) requests; then rescored by `TrainableModel` in
right-padded batches of 12, another grouping than the rollouts'. `fast` rows are the inverse control. The tiny models
are one per architecture of `models/architectures.py`, built by transformers' own config classes with random weights and
the embedded model's tokenizer (2 layers, hidden 256).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from margingate import LLM
from margingate.data.prompts import builtin_prompts
from margingate.engine import Request
from margingate.models.loader import resolve_model_dir
from margingate.options import SamplingParams
from margingate.paths import cache_root
from margingate.train import TrainableModel
from margingate.train.rollouts import compare, rescored, sample

SAMPLINGS = {"greedy": SamplingParams(), "seeded-t1": SamplingParams(temperature=1.0, seed=7),
             "processed-t0.7-p0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=9, logprobs_mode="processed")}
POLICIES = ("batch-invariant", "reference", "margin", "dvr", "fast")
ROLLOUT_BATCHES = (1, 2, 4, 8, 16, 16, 16, 1)  # 64 rollouts; --rollouts N takes the first batches that sum to N


def batches(n: int) -> list[int]:
    out = []
    for size in ROLLOUT_BATCHES:
        if sum(out) + size > n:
            break
        out.append(size)
    return out + ([n - sum(out)] if sum(out) < n else [])
TRAINER_BATCH = 12
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, initializer_range=0.05)
TINY_ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
              "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
              "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 64, "sliding_window": 32,
                                                                  "query_pre_attn_scalar": 64}),
              "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 64, "num_experts": 8,
                                                                      "num_experts_per_tok": 2,
                                                                      "moe_intermediate_size": 128}),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2})}


def tiny_model(arch: str, root: Path) -> str:
    """A random-weight model of `arch` with the embedded model's tokenizer, saved under root/arch."""
    import transformers as tf

    folder = root / arch
    if not (folder / "config.json").exists():
        config_cls, model_cls, fields = TINY_ARCHS[arch]
        embedded = resolve_model_dir("smollm2-135m")
        torch.manual_seed(0)
        config = getattr(tf, config_cls)(vocab_size=49152, **TINY, **fields)
        getattr(tf, model_cls)(config).to(torch.bfloat16).save_pretrained(folder)
        for f in embedded.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation")):
                shutil.copy(f, folder / f.name)
    return str(folder)


def rollouts_in_batches(llm: LLM, prompt_ids: list[list[int]], traffic: list[list[int]], sampling: SamplingParams,
                        policy: str, new_tokens: int) -> list:
    out, start = [], 0
    for i, size in enumerate(batches(len(prompt_ids))):
        others = [Request(p, new_tokens, llm.policy("fast"), request_id=f"traffic-{j}")
                  for j, p in enumerate(traffic[i % 4 * 4:i % 4 * 4 + 4])]
        batch = sample(llm.engine, prompt_ids[start:start + size], sampling.for_sample(start), llm.policy(policy),
                       max_new_tokens=new_tokens, traffic=others)
        out += batch
        start += size
    return out


def measure(model: str, policies: list[str], samplings: list[str], new_tokens: int, count: int) -> list[dict]:
    llm = LLM(model, weights="bf16", max_num_seqs=32)
    trainer = TrainableModel.from_pretrained(model)
    prompts = builtin_prompts()
    ids = [llm.tokenizer.encode_prompt(prompts[i % len(prompts)])[:16 + 7 * i] for i in range(80)]
    rows = []
    for policy in policies:
        for name in samplings:
            rollouts = rollouts_in_batches(llm, ids[:count], ids[64:], SAMPLINGS[name], policy, new_tokens)
            with torch.no_grad():
                rescores = [t for b in range(0, len(rollouts), TRAINER_BATCH)
                            for t in rescored(lambda i, m: trainer(i, attention_mask=m).logits,
                                              rollouts[b:b + TRAINER_BATCH])]
            found = compare(rollouts, rescores)
            rows.append({"model": Path(model).name, "architecture": llm.config.architecture, "policy": policy,
                         "sampling": name, **found.as_dict()})
            tqdm.write(f"{model} {policy} {name}: {found.differing} / {found.tokens} differ, max {found.max_abs:.3g}")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | architecture | policy | sampling | differing / sampled tokens | max abs difference |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['architecture']} | {r['policy']} | {r['sampling']} | {r['differing']} / "
              f"{r['tokens']} | {r['max_abs']:.3g} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m," + ",".join(f"tiny-{a}" for a in TINY_ARCHS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--samplings", default=",".join(SAMPLINGS))
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--rollouts", type=int, default=64, help="rollouts per (model, policy, sampling), at most 64")
    p.add_argument("--out", type=Path, default=Path("results/rl-parity"))
    p.add_argument("--name", default="parity")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in tqdm(args.models.split(","), desc="models"):
        if model.startswith("tiny-"):
            model = tiny_model(model.removeprefix("tiny-"), cache_root() / "tiny-models")
        rows += measure(model, args.policies.split(","), args.samplings.split(","), args.new_tokens,
                        min(args.rollouts, 64))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    (args.out / f"{args.name}.json").write_text(json.dumps({"cpu": cpu, "command": sys.argv, "rows": rows}, indent=1))
    (args.out / f"{args.name}.md").write_text(f"CPU: {cpu}, torch threads {torch.get_num_threads()}\n\n" + table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
