"""Random-weight bf16 models of the paper's shapes, and the prompt sets of one table.

The timings, not the text, are the point, so the weights are random (Llama layers at each model's own sizes
and vocabulary). The three prompt sets are drawn from one generator in turn and checked disjoint: tau is
fitted on `calibration` only, so that margin's gate is judged on prompts it never saw (`check`) and timed on
others again (`timed`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from ..models.decoder import DecoderModel

SHAPES = {  # hidden, intermediate, layers, heads, KV heads, head dim, vocabulary, RoPE base
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128, 128256, 500000.0),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 128, 152064, 1000000.0),
    # the dry run's stand-ins for the two (Triton's interpreter on CPU): the second a little larger
    "toy": (64, 128, 2, 4, 2, 16, 256, 10000.0),
    "toy-1": (32, 64, 1, 2, 1, 16, 128, 10000.0),  # the default tier's test: one layer, one tile per Linear
    "toy-wide": (96, 192, 3, 6, 2, 16, 384, 10000.0),
}
SHAPE_KEYS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab", "rope_theta")
STD = 0.02  # the weights' standard deviation


def config_of(name: str) -> ModelConfig:
    hidden, inter, layers, heads, kv, head_dim, vocab, theta = SHAPES[name]
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": head_dim, "rope_theta": theta, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "eos_token_id": vocab - 1}
    return ModelConfig.from_hf(raw, name=name)


def random_model(name: str, device: str, seed: int = 0) -> DecoderModel:
    """The shape's model on `device`, weights drawn there (an 8B model never passes through the host)."""
    hidden, inter, layers, heads, kv, head_dim, vocab, _ = SHAPES[name]
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
    return DecoderModel(config_of(name), state, device, kernels="triton")


def digest(outputs: list[list[int]]) -> str:
    """The token digest of a set of outputs (in order)."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


@dataclass
class PromptSets:
    """Token-id prompts: `calibration` (tau's fit), `check` (determinism) and `timed` (the bench)."""
    calibration: list[list[int]]
    check: list[list[int]]
    timed: list[list[int]]

    @classmethod
    def draw(cls, vocab: int, lengths: tuple[int, int], counts: tuple[int, int, int], seed: int = 1) -> PromptSets:
        """`counts` prompts per set, lengths in [lo, hi], drawn from one generator (the last token id, EOS,
        never appears); a prompt drawn twice is drawn again, so no prompt is in two sets."""
        gen, seen, sets = torch.Generator().manual_seed(seed), set(), []
        lo, hi = lengths
        for count in counts:
            drawn = []
            while len(drawn) < count:
                n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
                ids = tuple(torch.randint(0, vocab - 1, (n,), generator=gen).tolist())
                if ids not in seen:
                    seen.add(ids)
                    drawn.append(list(ids))
            sets.append(drawn)
        out = cls(*sets)
        out.assert_disjoint()
        return out

    def assert_disjoint(self) -> None:
        cal, chk, tim = ({tuple(p) for p in s} for s in (self.calibration, self.check, self.timed))
        if cal & chk or cal & tim or chk & tim:
            raise AssertionError("the calibration, check and timed prompt sets share a prompt")

    def fingerprints(self) -> dict[str, list[str]]:
        """Each prompt's digest per set: what the report records, so a reader (and the test) can see that
        tau's prompts are none of the checked or timed ones."""
        return {name: [digest([p]) for p in getattr(self, name)] for name in ("calibration", "check", "timed")}
