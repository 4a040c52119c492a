"""The trainable forward + backward beside transformers' on the same model and batch, and `update_weights`.

    python results/train-speed/bench.py --out results/train-speed

Batch: 8 sequences x 256 tokens of the embedded model (SmolLM2-135M), loss the summed NLL of every token (the
logits and log-softmax included, as an RL loss reads them). Contenders, each at the machine's default torch
threads, warm-up excluded, median of --repeats: `TrainableModel` with bf16 parameters and with fp32 master
weights; transformers with bf16 parameters and with fp32 parameters under bf16 autocast. Then
`LLM.update_weights` from a folder of safetensors, and the first request after it beside a fresh engine on that
folder (bitwise).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from margingate import LLM
from margingate.models.loader import load_state_dict, resolve_model_dir
from margingate.options import SamplingParams
from margingate.train import TrainableModel, token_logprobs


def step_seconds(forward, params, ids: torch.Tensor, repeats: int) -> list[float]:
    times = []
    for i in range(repeats + 1):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        logits = forward(ids)
        (-token_logprobs(logits[:, :-1].float(), ids[:, 1:]).sum()).backward()
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    return times


def contenders(folder: Path):
    import transformers as tf

    ours = TrainableModel.from_pretrained("smollm2-135m")
    master = TrainableModel.from_pretrained("smollm2-135m", param_dtype=torch.float32)
    hf16 = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    hf32 = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def autocast(ids):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return hf32(ids).logits
    return {"margingate TrainableModel, bf16 parameters": (lambda ids: ours(ids).logits, ours),
            "margingate TrainableModel, fp32 master weights": (lambda ids: master(ids).logits, master),
            "transformers, bf16 parameters": (lambda ids: hf16(ids).logits, hf16),
            "transformers, fp32 parameters + bf16 autocast": (autocast, hf32)}


def update_figures(folder: Path, tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.clone() for k, v in load_state_dict(folder).items()}
    state["model.norm.weight"] = (state["model.norm.weight"].float() * 1.01).to(torch.bfloat16)
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (tmp / f.name).write_bytes(f.read_bytes())
    save_file(state, tmp / "model.safetensors")
    llm = LLM(weights="bf16")
    t0 = time.perf_counter()
    llm.update_weights(str(tmp))
    seconds = time.perf_counter() - t0
    fresh = LLM(str(tmp), weights="bf16")
    asked = dict(max_new_tokens=32, ignore_eos=True, sampling=SamplingParams(logprobs=0))
    a = llm.generate(["Why is the sky blue?"], policy=llm.policy("batch-invariant"), **asked)[0]
    b = fresh.generate(["Why is the sky blue?"], policy=fresh.policy("batch-invariant"), **asked)[0]
    return {"update_weights_seconds": seconds, "first_request_equal_to_fresh_engine":
            (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs), "tokens": len(a.token_ids)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--positions", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results/train-speed"))
    args = p.parse_args()
    folder = resolve_model_dir("smollm2-135m")
    ids = torch.randint(0, 49152, (args.batch, args.positions), generator=torch.Generator().manual_seed(0))
    rows = {}
    for name, (forward, module) in contenders(folder).items():
        times = step_seconds(forward, list(module.parameters()), ids, args.repeats)
        rows[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
        print(name, rows[name], flush=True)
    base = rows["transformers, bf16 parameters"]["median_s"]
    update = update_figures(folder, args.out / "tmp-folder")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"CPU: {cpu}; torch threads {torch.get_num_threads()}; batch {args.batch} x {args.positions} tokens; "
             f"median of {args.repeats} after a warm-up", "",
             "| forward + backward | median s | min-max s | vs transformers bf16 |", "|---|---|---|---|"]
    lines += [f"| {n} | {r['median_s']:.2f} | {r['min_s']:.2f}-{r['max_s']:.2f} | {r['median_s'] / base:.2f}x |"
              for n, r in rows.items()]
    lines += ["", f"`update_weights` from a folder: {update['update_weights_seconds']:.2f} s; the first request after "
                  f"it ({update['tokens']} tokens) equal to a fresh engine on that folder, bitwise: "
                  f"{update['first_request_equal_to_fresh_engine']}"]
    (args.out / "bench.md").write_text("\n".join(lines) + "\n")
    report = {"cpu": cpu, "command": sys.argv, "rows": rows, **update}
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    for f in (args.out / "tmp-folder").iterdir():
        f.unlink()
    (args.out / "tmp-folder").rmdir()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
