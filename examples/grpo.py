"""GRPO on a verifiable task: rollouts from the engine, the loss from a trainer whose forward is the engine's.

    python examples/grpo.py --steps 12 --out results/grpo

Each step samples G answers to each of P small sums ("What is 3 + 5?") from the running engine (seeded,
temperature 1, batch-invariant), rewards an answer in which the sum appears, and takes one GRPO step
(group-normalized advantages, clipped importance ratio against the rollout's own logprobs, a k3 KL to the
initial model) with `TrainableModel` (fp32 master weights, bf16 forward), then puts the new weights into the
engine (`LLM.update_weights`). Before the step it records max |trainer logprob - rollout logprob| over every
sampled token: exactly 0 when the trainer is the engine, so the importance ratio of the first inner step is
exactly 1 and nothing needs clipping or masking. The inverse controls run the same loop with `fast` rollouts
(`--run fast`) or with transformers' forward as the trainer (`--run transformers`, fp32 weights under bf16
autocast, the usual mixed precision). Writes <out>/grpo.json, grpo.md and grpo.png.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch
from tqdm import tqdm

from margingate import LLM
from margingate.options import SamplingParams
from margingate.train import TrainableModel
from margingate.train.rollouts import compare, rescored, sample

RUNS = ("engine", "fast", "transformers")  # the trainer = engine loop, and its two inverse controls


def problems(step: int, count: int) -> list[tuple[str, int]]:
    rng = random.Random(step)
    pairs = [(rng.randint(1, 5), rng.randint(1, 5)) for _ in range(count)]
    return [(f"What is {a} + {b}? Answer with just the number.", a + b) for a, b in pairs]


def reward(text: str, answer: int) -> float:
    """1 if the sum appears as a number in the answer (a 135M model rarely answers with the number alone)."""
    return float(answer in (int(n) for n in re.findall(r"\d+", text)))


def trainer_for(run: str, model: str):
    """(module, its forward (ids, mask) -> fp32 logits, its state dict for the engine)."""
    if run != "transformers":
        trainer = TrainableModel.from_pretrained(model, param_dtype=torch.float32)
        return trainer, lambda ids, mask: trainer(ids, attention_mask=mask).logits
    from transformers import AutoModelForCausalLM

    from margingate.models.loader import resolve_model_dir

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=torch.float32)

    def forward(ids, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return hf(ids, attention_mask=mask).logits.float()
    return hf, forward


def grpo_loss(new: list[torch.Tensor], old: list[list[float]], ref: list[torch.Tensor], advantages: list[float],
              clip: float, beta: float) -> tuple[torch.Tensor, float]:
    """The clipped surrogate plus beta x k3 KL, each sequence's tokens averaged, then the sequences averaged."""
    losses, kls = [], []
    for lp, lp_old, lp_ref, adv in zip(new, old, ref, advantages):
        ratio = torch.exp(lp - torch.tensor(lp_old))
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        kl = torch.exp(lp_ref - lp) - (lp_ref - lp) - 1
        losses.append((-surrogate + beta * kl).mean())
        kls.append(float(kl.detach().mean()))
    return torch.stack(losses).mean(), sum(kls) / len(kls)


def advantages_of(rewards: list[float], group: int) -> list[float]:
    out = []
    for g in range(0, len(rewards), group):
        r = torch.tensor(rewards[g:g + group])
        out += ((r - r.mean()) / (r.std() + 1e-4)).tolist()
    return out


def grpo_step(step: int, llm: LLM, trainer, forward, reference: TrainableModel, opt, args) -> dict:
    t0 = time.perf_counter()
    tasks = problems(step, args.prompts)
    ids = [llm.requests([[{"role": "user", "content": q}]])[0].prompt_ids for q, _ in tasks for _ in range(args.group)]
    policy = llm.policy("fast" if args.run == "fast" else "batch-invariant")
    rollouts = sample(llm.engine, ids, SamplingParams(temperature=1.0, seed=1000 * step), policy,
                      max_new_tokens=args.max_new_tokens)
    answers = [a for _, a in tasks for _ in range(args.group)]
    rewards = [reward(llm.tokenizer.decode(r.token_ids), a) for r, a in zip(rollouts, answers)]
    t1 = time.perf_counter()
    new = rescored(forward, rollouts)
    with torch.no_grad():
        ref = rescored(lambda i, m: reference(i, attention_mask=m).logits, rollouts)
    mismatch = compare(rollouts, new)
    loss, kl = grpo_loss(new, [r.logprobs for r in rollouts], ref, advantages_of(rewards, args.group), args.clip,
                         args.beta)
    opt.zero_grad()
    loss.backward()
    opt.step()
    t2 = time.perf_counter()
    version = llm.update_weights(trainer.state_dict())
    t3 = time.perf_counter()
    return {"step": step, "reward": sum(rewards) / len(rewards), "kl": kl, "loss": float(loss),
            "mismatch_max_abs": mismatch.max_abs, "mismatching_tokens": mismatch.differing,
            "sampled_tokens": mismatch.tokens, "weight_version": version, "seconds_rollout": t1 - t0,
            "seconds_train": t2 - t1, "seconds_update": t3 - t2, "seconds_step": t3 - t0}


def run(args) -> list[dict]:
    torch.manual_seed(0)
    llm = LLM(args.model, weights="bf16", max_num_seqs=args.prompts * args.group)
    trainer, forward = trainer_for(args.run, args.model)
    reference = TrainableModel.from_pretrained(args.model).requires_grad_(False)
    opt = torch.optim.AdamW(trainer.parameters(), lr=args.lr, weight_decay=0.0)
    return [grpo_step(step, llm, trainer, forward, reference, opt, args)
            for step in tqdm(range(args.steps), desc=f"GRPO ({args.run})")]


def report(runs: dict[str, list[dict]], out: Path) -> None:
    lines = ["| run | step | reward | KL | max abs(trainer - rollout logprob) | mismatching / sampled | s/step |",
             "|---|---|---|---|---|---|---|"]
    for name, steps in runs.items():
        lines += [f"| {name} | {s['step']} | {s['reward']:.3f} | {s['kl']:.2e} | {s['mismatch_max_abs']:.3g} | "
                  f"{s['mismatching_tokens']} / {s['sampled_tokens']} | {s['seconds_step']:.1f} |" for s in steps]
    (out / "grpo.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, steps in runs.items():
        x = [s["step"] for s in steps]
        top.plot(x, [s["reward"] for s in steps], marker="o", label=name)
        bottom.plot(x, [max(s["mismatch_max_abs"], 1e-9) for s in steps], marker="o", label=name)
    top.set_ylabel("mean reward")
    bottom.set_ylabel("max |trainer - rollout| logprob")
    bottom.set_yscale("log")
    bottom.set_xlabel("GRPO step")
    bottom.text(0.01, 0.02, "1e-9 drawn for exactly 0", transform=bottom.transAxes, fontsize=8)
    top.legend()
    fig.tight_layout()
    fig.savefig(out / "grpo.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--out", type=Path, default=Path("results/grpo"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in args.runs.split(","):
        args.run = name
        runs[name] = run(args)
    (args.out / "grpo.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                    "runs": runs}, indent=1))
    report(runs, args.out)
    print((args.out / "grpo.md").read_text())


if __name__ == "__main__":
    main()
