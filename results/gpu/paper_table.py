"""The paper's table on one GPU: MarginGate against LLM-42's decode-verify-rollback, at the hardware's speed.

    python results/gpu/paper_table.py                  # CUDA: Llama-3.1-8B and Qwen2.5-14B shapes, B = 1, 8, 32, 64
    python results/gpu/paper_table.py --device cpu     # dry run: a toy shape under Triton's interpreter

Per shape, one random-weight bf16 model built on the device (Llama layers at each model's own sizes and
vocabulary; random weights: the timings, not the text, are the point):
1. the device's copy bandwidth, and each batch's memory-read floor (weights + K/V bytes per step over it);
2. tau fit on this GPU: `fast` and `batch-invariant` decode the same prompts at the largest batch; tau is the
   smallest margin above every fast step that chose another token than batch-invariant (x 1.05);
3. `check`: 8 prompts of different lengths, arriving over 4 steps, under each policy, against each alone
   under batch-invariant: sequence determinism and the token digest;
4. per batch size and policy (fast, batch-invariant, margin, dvr with W 64 and G 8 as LLM-42, verify-all):
   the time of B requests x `--new` tokens after a warm-up run, its increase over fast, margin's trigger rate,
   and dvr's increase over margin's, beside the paper's 2.23x.
Writes paper.json and paper.md under results/gpu/<GPU name>/paper/ (dry run: results/gpu/dry-run-cpu/paper/).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from margingate.engine import Request  # noqa: E402
from margingate.engine.engine import Engine, EngineConfig  # noqa: E402
from margingate.models.config import ModelConfig  # noqa: E402
from margingate.models.decoder import DecoderModel  # noqa: E402
from margingate.models.weights import streamed_bytes  # noqa: E402
from margingate.options import PolicySpec  # noqa: E402
from margingate.policies import FastPolicy, build  # noqa: E402
from margingate.policies.margin import margin_of  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, heads, KV heads, head dim, vocabulary, RoPE base
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128, 128256, 500000.0),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 128, 152064, 1000000.0),
    "toy": (64, 128, 2, 4, 2, 16, 256, 10000.0),  # the dry run's
}
PAPER_RATIO = 2.23  # the paper: dvr's latency increase over margin's, Llama-3.1-8B
POLICIES = {"fast": PolicySpec("fast"), "batch-invariant": PolicySpec("batch-invariant"),
            "margin": None, "dvr": PolicySpec("dvr", window=64, group=8), "verify-all": PolicySpec("verify-all")}
STD = 0.02


def random_model(name: str, device: str, seed: int = 0) -> DecoderModel:
    hidden, inter, layers, heads, kv, head_dim, vocab, theta = SHAPES[name]
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": head_dim, "rope_theta": theta, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": vocab - 1}
    config = ModelConfig.from_hf(raw, name=name)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = heads * head_dim, kv * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (k, hidden),
                       p + "self_attn.v_proj.weight": (k, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)})
    state = {n: torch.ones(s, dtype=torch.bfloat16, device=device) if len(s) == 1 else
             torch.empty(s, dtype=torch.bfloat16, device=device).normal_(0.0, STD, generator=gen)
             for n, s in shapes.items()}
    return DecoderModel(config, state, device, kernels="triton")


def bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy, read and written bytes counted."""
    if device != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 10 * x.numel() / (time.perf_counter() - t)


def prompts(vocab: int, count: int, lo: int, hi: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


def engine(model: DecoderModel, batch: int, max_len: int) -> Engine:
    return Engine(model, EngineConfig(max_num_seqs=batch, max_model_len=max_len), lambda: build(PolicySpec("fast")))


def decode(eng: Engine, ids: list[list[int]], new: int, policy, arrivals: bool = False) -> tuple[list, float]:
    """Results of `ids` under `policy` (a spec, or a policy object) and the wall time."""
    make = (lambda: build(policy)) if isinstance(policy, PolicySpec) else (lambda: policy)
    reqs = [Request(x, new, make(), ignore_eos=True, request_id=f"r{i}", arrival_step=i // 2 if arrivals else 0)
            for i, x in enumerate(ids)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = eng.generate(reqs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


class MarginRecorder(FastPolicy):
    """`fast`, recording each step's margin per request (tau's fit)."""

    def __init__(self):
        super().__init__(PolicySpec("fast"))
        self.margins: dict[str, list[float]] = {}

    def commit(self, seq, step, verified):
        self.margins.setdefault(seq.request_id, []).append(margin_of(step.scores))
        super().commit(seq, step, verified)


def fit_tau(model, ids, new: int, max_len: int) -> dict:
    """tau above every margin at which fast chose another token than batch-invariant (first divergences)."""
    eng = engine(model, len(ids), max_len)
    ref, _ = decode(eng, ids, new, PolicySpec("batch-invariant"))
    recorder = MarginRecorder()
    fast, _ = decode(eng, ids, new, recorder)
    flips = []
    for r, f in zip(ref, fast):
        k = next((i for i, (a, b) in enumerate(zip(r.token_ids, f.token_ids)) if a != b), None)
        if k is not None:
            flips.append(recorder.margins[f.request_id][k - 1] if k else float("nan"))
    all_margins = sorted(m for ms in recorder.margins.values() for m in ms)
    found = [m for m in flips if m == m]
    tau = 1.05 * max(found) if found else all_margins[len(all_margins) // 10]  # none: the 10th percentile
    return {"tau": tau, "flips": len(flips), "requests": len(ids), "flip_margins": found,
            "rule": "1.05 x the largest flip margin" if found else "no flip seen: the 10th percentile of margins"}


def digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def check(model, ids, new: int, max_len: int, tau: float) -> dict:
    """Each policy's batch (arrivals over 4 steps) against each request alone under batch-invariant."""
    alone_eng = engine(model, 1, max_len)
    alone = [decode(alone_eng, [x], new, PolicySpec("batch-invariant"))[0][0].token_ids for x in ids]
    eng, out = engine(model, len(ids), max_len), {}
    eager = Engine(model, EngineConfig(max_num_seqs=len(ids), max_model_len=max_len, step_graphs="off"),
                   lambda: build(PolicySpec("fast")))
    runs = [(name, eng, spec) for name, spec in specs(tau).items()]
    for name, e, spec in runs + [("batch-invariant, no graphs", eager, PolicySpec("batch-invariant"))]:
        got = [r.token_ids for r in decode(e, ids, new, spec, arrivals=True)[0]]
        out[name] = {"sequence_determinism": sum(a == b for a, b in zip(alone, got)) / len(ids),
                     "digest": digest(got)}
    out["alone"] = {"digest": digest(alone)}
    return out


def specs(tau: float) -> dict[str, PolicySpec]:
    return {k: v if v is not None else PolicySpec("margin", tau=tau) for k, v in POLICIES.items()}


def bench(model, ids, new: int, batch: int, max_len: int, tau: float) -> dict:
    """Each policy: B requests x `new` tokens, timed after a warm-up run (graphs recorded, kernels built)."""
    eng, out = engine(model, batch, max_len), {}
    for name, spec in specs(tau).items():
        try:
            decode(eng, ids[:batch], new, spec)
            results, seconds = decode(eng, ids[:batch], new, spec)
        except Exception as exc:  # noqa: BLE001  (one failing policy is reported, the table goes on)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        steps = sum(r.stats.get("steps", 0) for r in results) or 1
        out[name] = {"seconds": seconds, "ms_per_step": 1000 * seconds / new,
                     "trigger_rate": sum(r.stats.get("triggers", 0) for r in results) / steps}
    fast = out["fast"].get("seconds")
    for row in out.values():
        if fast and "seconds" in row:
            row["increase"] = row["seconds"] / fast - 1
    return out


def floor_ms(model: DecoderModel, batch: int, context: int, bw: float) -> float:
    """Milliseconds to read the weights and the batch's K/V once at the given bandwidth."""
    cfg = model.config
    weights = streamed_bytes(model.own_weights)
    kv = batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    return 1000 * (weights + kv) / bw


def run_shape(name: str, args, bw: float, report: dict, save) -> None:
    """Fill `report` for one shape, calling `save` after each part (a run cut short keeps what it finished)."""
    t0 = time.perf_counter()
    model = random_model(name, args.device)
    vocab, batches = model.config.vocab_size, args.batch_sizes
    lo, hi = args.prompt_len
    ids = prompts(vocab, max(batches), lo, hi)
    max_len = hi + args.new + 16
    report.update(shape=dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab",
                                  "rope_theta"), SHAPES[name])), build_seconds=time.perf_counter() - t0)
    report["tau"] = fit_tau(model, ids[:max(batches)], args.new, max_len)
    tau = report["tau"]["tau"]
    print(f"[{name}] tau {tau:.4g} ({report['tau']['rule']}; {report['tau']['flips']} flips)", flush=True)
    report["check"] = check(model, prompts(vocab, 8, lo // 2, hi, seed=2), args.new, max_len, tau)
    print(f"[{name}] check {json.dumps(report['check'])}", flush=True)
    report["bench"] = {}
    save()
    for b in batches:
        row = bench(model, ids, args.new, b, max_len, tau)
        row["floor_ms"] = floor_ms(model, b, hi + args.new // 2, bw)
        report["bench"][f"B{b}"] = row
        print(f"[{name}] B={b} {json.dumps(row)}", flush=True)
        save()
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()


def percent(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def markdown(rep: dict) -> str:
    dry = " (Triton's interpreter: the timings say nothing)" if rep["device"] == "dry-run-cpu" else ""
    lines = [f"# The paper's table: {rep['device']}{dry}", "", f"torch {rep['torch']}, copy bandwidth "
             f"{rep['bandwidth_GBps']:.0f} GB/s, {rep['new']} new tokens per request, prompts of "
             f"{rep['prompt_len'][0]}-{rep['prompt_len'][1]} tokens, random bf16 weights", ""]
    for name, r in rep["shapes"].items():
        if "check" not in r:
            continue
        t = r["tau"]
        lines += [f"## {name}", "", f"tau {t['tau']:.4g}: {t['rule']} ({t['flips']} of {t['requests']} requests "
                  f"flipped under fast)", "", "| policy | sequence determinism | digest |", "|---|---|---|"]
        lines += [f"| {p} | {100 * c['sequence_determinism']:.1f} % | {c['digest']} |"
                  for p, c in r["check"].items() if p != "alone"]
        lines += ["", "ms / token: a run's wall time (B requests, prefill included) over its new tokens per request; "
                  "of floor: the memory-read floor of one decode step over fast's ms / token", "",
                  "| B | policy | ms / token | increase over fast | margin trigger rate | of floor |",
                  "|---|---|---|---|---|---|"]
        for b, row in r["bench"].items():
            for p in POLICIES:
                x = row.get(p, {})
                if "error" in x:
                    lines.append(f"| {b[1:]} | {p} | {x['error'][:80]} | | | |")
                    continue
                trig = f"{100 * x['trigger_rate']:.1f} %" if p == "margin" else ""
                of = f"{row['floor_ms'] / x['ms_per_step']:.2f}" if p == "fast" and row["floor_ms"] == \
                    row["floor_ms"] else ""
                lines.append(f"| {b[1:]} | {p} | {x['ms_per_step']:.2f} | {percent(x.get('increase'))} | {trig} "
                             f"| {of} |")
        lines += ["", f"dvr's increase over margin's (the paper: {PAPER_RATIO}x)", "",
                  "| B | margin | dvr | dvr / margin |", "|---|---|---|---|"]
        for b, row in r["bench"].items():
            m, d = row.get("margin", {}).get("increase"), row.get("dvr", {}).get("increase")
            ratio = f"{d / m:.2f}x" if m and d is not None and m > 0 else "-"
            lines.append(f"| {b[1:]} | {percent(m)} | {percent(d)} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--shapes", default=None, help="comma-separated (default: both models; toy on cpu)")
    p.add_argument("--batch-sizes", default=None, help="default 1,8,32,64 (cpu: 1,2)")
    p.add_argument("--new", type=int, default=None, help="new tokens per request (default 64; cpu: 4)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.shapes = (args.shapes or ("llama-3.1-8b,qwen2.5-14b" if cuda else "toy")).split(",")
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("1,8,32,64" if cuda else "1,2")).split(",")]
    args.new = args.new or (64 if cuda else 4)
    args.prompt_len = (64, 192) if cuda else (4, 12)
    device_name = torch.cuda.get_device_name(0) if cuda else "dry-run-cpu"
    out = args.out or ROOT / "results" / "gpu" / "".join(c if c.isalnum() or c in "._-" else "_"
                                                         for c in device_name) / "paper"
    bw = bandwidth(args.device)
    rep = {"device": device_name, "torch": torch.__version__, "bandwidth_GBps": bw / 1e9, "new": args.new,
           "prompt_len": args.prompt_len, "batch_sizes": args.batch_sizes, "shapes": {}}
    def save() -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "paper.json").write_text(json.dumps(rep, indent=2))
        (out / "paper.md").write_text(markdown(rep))

    for name in args.shapes:
        run_shape(name, args, bw, rep["shapes"].setdefault(name, {}), save)
    print(markdown(rep))


if __name__ == "__main__":
    main()
