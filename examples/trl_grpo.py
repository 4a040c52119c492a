"""TRL's GRPOTrainer with margingate rollouts, through TRL's experimental `rollout_func`.

    pip install "trl==1.16.*" torch==2.13.0    # not a margingate dependency; pin torch so pip keeps it
    PYTHONPATH=. python examples/trl_grpo.py --steps 6 --out results/trl-grpo    # figures: results/trl-grpo

The task is examples/grpo.py's: sums of 1-5, reward 1 when the sum appears as a number in the answer.
TRL owns the loop (its own dataloader, advantages, loss and AdamW on transformers' `AutoModelForCausalLM`);
margingate only samples: `rollout_func` runs the engine (seeded, temperature 1, batch-invariant) and hands TRL
each completion's token ids and the engine's logprob of every sampled token; a callback puts the new weights
into the engine after every optimizer step (`LLM.update_weights`).

TRL 1.16 reads those rollout logprobs only when `use_vllm=True` (its `sampling/*` metrics and its importance
sampling correction are all gated on it, and `use_vllm` needs vLLM installed). Here, without vLLM, TRL takes
its own no-grad forward as the "old" policy, so the rollout/trainer mismatch is neither corrected nor logged.
`MeasuredGRPOTrainer` measures it with TRL's own scoring function (`_get_per_token_logps_and_entropies`, the one
TRL's `sampling/*` metrics use under vLLM) and logs it beside TRL's metrics as `rollout_vs_trainer/*`.
Writes <out>/trl_grpo.json: TRL's log of every step, those metrics included.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from examples.grpo import problems, reward
from margingate import LLM
from margingate.models.loader import resolve_model_dir
from margingate.options import SamplingParams
from margingate.train.rollouts import sample

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's warning: we know it is experimental


def sums_dataset(count: int) -> Dataset:
    """Conversational prompts, with the sum as a column TRL passes to the reward function by name."""
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in problems(0, count)]
    return Dataset.from_list(rows)


def sum_reward(completions, answer, **_) -> list[float]:
    # completions are conversational here: [{"role": "assistant", "content": text}] per completion
    return [reward(c[0]["content"], a) for c, a in zip(completions, answer)]


def margingate_rollouts(llm: LLM, max_new_tokens: int, seed: int):
    """TRL's rollout_func: it gets the prompts already repeated num_generations times (TRL's RepeatSampler),
    so one completion per prompt it gets; sample i takes seed + i, so each copy draws its own answer."""
    def rollout_func(prompts: list, trainer: GRPOTrainer) -> dict:
        ids = [r.prompt_ids for r in llm.requests(prompts)]  # the chat template, applied by the engine
        sampling = SamplingParams(temperature=trainer.temperature, seed=seed + 1000 * trainer.state.global_step)
        rollouts = sample(llm.engine, ids, sampling, llm.policy("batch-invariant"), max_new_tokens=max_new_tokens)
        return {"prompt_ids": [r.prompt_ids for r in rollouts], "completion_ids": [r.token_ids for r in rollouts],
                "logprobs": [r.logprobs for r in rollouts]}
    return rollout_func


class EngineWeights(TrainerCallback):
    """After each optimizer step, the trainer's weights into the engine: the next rollouts are on-policy."""

    def __init__(self, llm: LLM):
        self.llm, self.versions = llm, []

    def on_step_end(self, args, state, control, model=None, **_):
        self.versions.append(self.llm.update_weights(model.state_dict()))


class MeasuredGRPOTrainer(GRPOTrainer):
    """GRPOTrainer, plus the rollout-vs-trainer logprob mismatch that TRL only logs under vLLM."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        rollout = out.get("sampling_per_token_logps")  # the engine's logprobs, padded by TRL
        if rollout is not None:
            self._log_mismatch(out, rollout)
        return out

    @torch.no_grad()
    def _log_mismatch(self, out: dict, rollout: torch.Tensor) -> None:
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        width = out["completion_ids"].size(1)
        trainer, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, width)
        keep = out["completion_mask"].bool()
        diff = (trainer - rollout)[keep].double()
        ratio = diff.exp()  # the token-level importance ratio pi_trainer / pi_rollout that vLLM mode would apply
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["rollout_vs_trainer/logp_abs_diff/mean"].append(diff.abs().mean().item())
        metrics["rollout_vs_trainer/logp_abs_diff/max"].append(diff.abs().max().item())
        metrics["rollout_vs_trainer/differing_tokens"].append(int((diff != 0).sum()))
        metrics["rollout_vs_trainer/sampled_tokens"].append(diff.numel())
        for name, value in (("min", ratio.min()), ("mean", ratio.mean()), ("max", ratio.max())):
            metrics[f"rollout_vs_trainer/token_is_ratio/{name}"].append(value.item())


def grpo_config(args, output_dir: str) -> GRPOConfig:
    return GRPOConfig(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=1.0,
        learning_rate=args.lr, beta=args.beta, seed=args.seed, use_cpu=True,
        # bf16 here is fp32 weights under bf16 autocast, the same mixed precision as examples/grpo.py's
        # `transformers` control, so the mismatch below is the forward's, not fp32 weights against bf16 ones
        bf16=args.bf16, logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0)


def train(args) -> dict:
    torch.manual_seed(args.seed)
    llm = LLM(args.model, weights="bf16", max_num_seqs=args.batch)
    folder = resolve_model_dir(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weights = EngineWeights(llm)
    with tempfile.TemporaryDirectory() as scratch:  # TRL wants an output_dir; nothing in it is kept
        trainer = MeasuredGRPOTrainer(
            model=model, reward_funcs=sum_reward, args=grpo_config(args, scratch),
            train_dataset=sums_dataset(args.steps * args.batch), processing_class=AutoTokenizer.from_pretrained(folder),
            rollout_func=margingate_rollouts(llm, args.max_new_tokens, args.seed), callbacks=[weights])
        trainer.train()
    steps = [entry for entry in trainer.state.log_history if "reward" in entry]
    return {"steps": steps, "engine_weight_versions": weights.versions}


def cpu_name() -> str:
    found = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in found.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size (completions per step)")
    p.add_argument("--group", type=int, default=4, help="num_generations")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--beta", type=float, default=0.0, help="TRL's default: no reference model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path, default=Path("results/trl-grpo"))
    args = p.parse_args()
    run = train(args)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "trl": trl.__version__,
              "torch": torch.__version__, "cpu": cpu_name(), **run}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "trl_grpo.json" if args.bf16 else "trl_grpo_fp32.json"
    (args.out / name).write_text(json.dumps(record, indent=1))
    for s in run["steps"]:
        print({k: s.get(k) for k in ("step", "reward", "rollout_vs_trainer/logp_abs_diff/max",
                                     "rollout_vs_trainer/token_is_ratio/min", "rollout_vs_trainer/token_is_ratio/max")})


if __name__ == "__main__":
    main()
