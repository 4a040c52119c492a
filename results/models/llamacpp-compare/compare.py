"""Issue 46's second reference: llama.cpp on the very GGUF files we load. For each architecture a small
random transformers model (the embedded model's tokenizer and vocabulary) is written as a BF16 GGUF by
our exporter; llama.cpp (make llamacpp-venv) and our `reference` policy each decode 4 prompts greedily
from the same token ids, EOS ignored. Where the tokens part, the table gives the first divergence and
our logprob gap there between our token and llama.cpp's: a near-tie (a gap of a few 1e-3, which the
two engines' bf16 roundings can cross), or a real difference.

    .venv/bin/python results/models/llamacpp-compare/compare.py   # writes table.md and table.json beside it
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers as tf

from margingate.llm import LLM
from margingate.models.gguf_export import write_bf16_gguf
from margingate.models.loader import resolve_model_dir

ROOT = Path(__file__).resolve().parents[3]
SHAPE = dict(vocab_size=49152, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, intermediate_size=256)
KINDS = {  # name: (config class, model class, config fields)
    "Llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=512)),
    "Qwen2 (q/k/v bias)": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=512)),
    "Qwen3 (q/k norms)": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=512, head_dim=32)),
    "Qwen3-MoE (8 experts, top 2)": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                     dict(MOE, moe_intermediate_size=128, num_experts=8, head_dim=32,
                                          norm_topk_prob=True)),
    "Mixtral (8 experts, top 2)": ("MixtralConfig", "MixtralForCausalLM", dict(MOE, num_local_experts=8)),
}
# The control: the Qwen3-MoE file for llama.cpp, and for us its folder read with norm_topk_prob false (the kept
# experts' weights not renormalized): a real difference, which the table must show as one.
CONTROL = "control: Qwen3-MoE, ours without norm_topk_prob"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "1, 2, 3, 4,"]
NEW_TOKENS = 32


def make_folder(config_name: str, model_name: str, fields: dict, out: Path, tokenizer: Path) -> Path:
    torch.manual_seed(0)
    model = getattr(tf, model_name)(getattr(tf, config_name)(**SHAPE, **fields, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, mean=1.0, std=0.2)
            elif name.endswith("bias") or "gate.weight" in name:
                torch.nn.init.normal_(p, std=0.5)
            else:
                p.mul_(3)  # sharper logits: fewer near-ties for either engine to cross
    model.to(torch.bfloat16).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer / f, out / f)
    return out


def llama_cpp(gguf: Path, prompt_ids: list[list[int]], tmp: Path, continuations=None) -> dict:
    """llama.cpp's greedy tokens for each prompt alone ("alone"), or with `continuations` the logprob of
    each of their tokens ("logprobs") (margingate/peers/llamacpp_worker.py)."""
    job, result = tmp / "job.json", tmp / "result.json"
    spec = {"gguf": str(gguf), "prompt_ids": prompt_ids, "max_new_tokens": NEW_TOKENS, "batch_size": 1,
            "repeats": 0, "warmup": 0, "threads": torch.get_num_threads()}
    job.write_text(json.dumps(spec if continuations is None else {**spec, "continuations": continuations}))
    worker = ROOT / "margingate" / "peers" / "llamacpp_worker.py"
    subprocess.run([str(ROOT / ".venv-llamacpp" / "bin" / "python"), str(worker), str(job), str(result)], check=True)
    return json.loads(result.read_text())


def compare(llm: LLM, prompt: list[int], ours: list[int], theirs: list[int]) -> dict:
    """Where the two greedy runs part, and our logprob gap there between our token and theirs."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if at is None:
        return {"same": True}
    context = prompt + ours[:at]
    mine, other = (llm.score(context, [t]).logprobs[0] for t in (ours[at], theirs[at]))
    return {"same": False, "first divergence": at, "gap": mine - other}


def main() -> None:
    rows, here = [], Path(__file__).parent
    tokenizer = resolve_model_dir("smollm2-135m")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = [*KINDS.items(), (CONTROL, KINDS["Qwen3-MoE (8 experts, top 2)"])]
        for name, (config_name, model_name, fields) in runs:
            folder = make_folder(config_name, model_name, fields, tmp / model_name, tokenizer)
            gguf = write_bf16_gguf(folder, tmp / f"{model_name}.bf16.gguf")
            if name == CONTROL:
                config = json.loads((folder / "config.json").read_text())
                (folder / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
            llm = LLM(str(folder if name == CONTROL else gguf), max_num_seqs=4)
            ids = [r.prompt_ids for r in llm.requests(PROMPTS)]
            ours = [c.token_ids for c in llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                      policy=llm.policy("reference"))]
            run = llama_cpp(gguf, ids, tmp)
            theirs, version = run["alone"], run["version"]
            found = [compare(llm, p, a, b) for p, a, b in zip(ids, ours, theirs)]
            # both engines' logprobs of our greedy tokens, teacher-forced: how far apart the forwards are
            mine = [llm.score(p, a).logprobs for p, a in zip(ids, ours)]
            other = llama_cpp(gguf, ids, tmp, continuations=ours)["logprobs"]
            diff = torch.tensor(mine) - torch.tensor(other)
            row = {"model": name, "prompts": len(PROMPTS), "identical": sum(f["same"] for f in found),
                   "divergences": [f for f in found if not f["same"]], "llama-cpp-python": version,
                   "mean abs logprob diff": diff.abs().mean().item(), "max": diff.abs().max().item()}
            rows.append(row)
            print(row, file=sys.stderr)
    lines = ["| architecture | logprobs of our tokens, mean / max abs diff | prompts x 32 greedy tokens identical "
             "| first divergence: step, our logprob of our token less llama.cpp's (nats) |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['mean abs logprob diff']:.1e} / {r['max']:.1e} | "
              f"{r['identical']} / {r['prompts']} | "
              + ("; ".join(f"step {d['first divergence']}, {d['gap']:.2e}" for d in r["divergences"]) or "-")
              + " |" for r in rows]
    (here / "table.md").write_text("\n".join(lines) + "\n")
    (here / "table.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
