"""gpt-oss's second oracle: llama.cpp on the very GGUF files we load (issue 64, item 2).

A small random gpt-oss from transformers' own classes (hidden 256, 4 layers alternating a 16-key window with full
attention, 8 experts top 4, YaRN, sinks and biases spread from their zeros; the embedded model's tokenizer) is
written as a BF16 GGUF by our exporter, and quantized by llama.cpp's own quantizer to MXFP4_MOE (MXFP4 experts,
Q8_0 elsewhere). For each file, llama.cpp and our `reference` policy decode 4 prompts greedily from the same ids
(32 tokens, EOS ignored), and both engines score our tokens (teacher-forced); for the BF16 file transformers'
fp32 forward on the folder scores them too (the sharp oracle). The MXFP4 file runs on our side kept quantized
under the int8 contract (its experts as Q5_0-shaped codes, docs/models.md).

    .venv/bin/python results/gpt-oss/llamacpp_compare.py   # writes llamacpp.md and llamacpp.json beside it
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "results" / "models" / "llamacpp-compare"))

from compare import NEW_TOKENS, PROMPTS, compare, llama_cpp, make_folder  # noqa: E402

from margingate.llm import LLM  # noqa: E402
from margingate.models.gguf_export import write_bf16_gguf  # noqa: E402
from margingate.models.loader import resolve_model_dir  # noqa: E402

FIELDS = dict(num_local_experts=8, num_experts_per_tok=4, intermediate_size=256, head_dim=32, sliding_window=16,
              attention_bias=True)


def transformers_logprobs(folder: Path, ids: list[list[int]], ours: list[list[int]]) -> list[list[float]]:
    """transformers' fp32 forward on the folder: the logprob of each of our tokens."""
    import transformers as tf

    model = tf.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, a in zip(ids, ours):
            x = torch.tensor(p + a)[None]
            lp = model(x).logits[0].float().log_softmax(-1)
            out.append([lp[len(p) - 1 + i, t].item() for i, t in enumerate(a)])
    return out


def run(llm: LLM, gguf: Path, tmp: Path) -> tuple[dict, list, list]:
    ids = [r.prompt_ids for r in llm.requests(PROMPTS)]
    ours = [c.token_ids for c in llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                              policy=llm.policy("reference"))]
    got = llama_cpp(gguf, ids, tmp)
    found = [compare(llm, p, a, b) for p, a, b in zip(ids, ours, got["alone"])]
    mine = [llm.score(p, a).logprobs for p, a in zip(ids, ours)]
    other = llama_cpp(gguf, ids, tmp, continuations=ours)["logprobs"]
    diff = torch.tensor(mine) - torch.tensor(other)
    row = {"identical": sum(f["same"] for f in found), "prompts": len(PROMPTS), "llama-cpp-python": got["version"],
           "divergences": [f for f in found if not f["same"]], "mean abs logprob diff": diff.abs().mean().item(),
           "max": diff.abs().max().item()}
    return row, ids, (ours, mine)


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = make_folder("GptOssConfig", "GptOssForCausalLM", FIELDS, tmp / "gpt-oss",
                             resolve_model_dir("smollm2-135m"))
        bf16 = write_bf16_gguf(folder, tmp / "gpt-oss.bf16.gguf")
        mxfp4 = tmp / "gpt-oss.mxfp4.gguf"
        subprocess.run([str(ROOT / ".venv-llamacpp" / "bin" / "python"), str(ROOT / "scripts" / "quantize_gguf.py"),
                        str(bf16), str(mxfp4), "mxfp4_moe"], check=True)
        for name, gguf in (("BF16", bf16), ("MXFP4_MOE (llama.cpp's quantizer)", mxfp4)):
            llm = LLM(str(gguf), max_num_seqs=4)
            row, ids, (ours, mine) = run(llm, gguf, tmp)
            row["file"] = name
            if gguf == bf16:
                truth = torch.tensor(transformers_logprobs(folder, ids, ours))
                row["vs transformers fp32, mean / max"] = [(torch.tensor(mine) - truth).abs().mean().item(),
                                                           (torch.tensor(mine) - truth).abs().max().item()]
            rows.append(row)
            print(row, file=sys.stderr)
    lines = [f"gpt-oss (hidden 256, 4 layers, 8 experts top 4), {len(PROMPTS)} prompts x {NEW_TOKENS} greedy tokens, "
             f"{platform.processor() or platform.machine()}", "",
             "| file | logprobs of our tokens vs llama.cpp, mean / max abs diff | greedy runs identical | "
             "first divergence: step, our gap (nats) | ours vs transformers fp32, mean / max |",
             "|---|---|---|---|---|"]
    for r in rows:
        hf = r.get("vs transformers fp32, mean / max")
        lines.append(f"| {r['file']} | {r['mean abs logprob diff']:.1e} / {r['max']:.1e} | {r['identical']} / "
                     f"{r['prompts']} | " + ("; ".join(f"{d['first divergence']}, {d['gap']:.2e}"
                                                      for d in r["divergences"]) or "-")
                     + f" | {f'{hf[0]:.1e} / {hf[1]:.1e}' if hf else '-'} |")
    (HERE / "llamacpp.md").write_text("\n".join(lines) + "\n")
    (HERE / "llamacpp.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
