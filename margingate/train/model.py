"""A trainable model whose forward is the engine's, bitwise: `TrainableModel`.

The same model description (`ModelConfig`, its `LayerSpec`, the architecture's name map) and the same
decoder layer (`models.decoder.decoder_layer`) as the engine, run through the invariant kernels with
gradients (`autograd.TRAIN`). Each token of a padded batch is one exact row attending over its own
sequence's earlier tokens, which is what every engine row is (prompt, chunk, decode, verifier), so
`logits[b, p]` is the engine's logit row for the token after position p, bitwise, at any batch size,
padding or mix of lengths. MoE routing is the engine's (the route's ids come from its kernel). Either backend:
the compiled CPU kernels, or the Triton ones (`kernels="triton"`), each bitwise its own engine.

Parameters carry transformers' names (`state_dict()` is what `LLM.update_weights` takes). They may be
bf16, or fp32 master weights rounded to bf16 on every forward exactly as the engine's load rounds them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..kernels import layers
from ..kernels import triton as triton_kernels
from ..kernels.attention import AttentionPlan, AttentionRows
from ..models.config import ModelConfig
from ..models.decoder import decoder_layer, rope_lookup, rotary_tables, scale_embedding
from ..models.kv_cache import KVPool, blocks_for
from ..models.loader import load_config, load_state_dict, resolve_model_dir
from ..models.weights import EXTRA_LAYER_MAP, PACKED, LayerWeights, ModelWeights, check
from .autograd import AttentionSite, Param, attention, kernel_set

BLOCK = 16  # the attention pool's block size: a memory choice, never a numerics one (csrc/contract.h)


@dataclass
class CausalLMOutput:
    """As transformers' causal LMs return it: `logits` [batch, positions, vocab], fp32 (padding rows: 0)."""
    logits: torch.Tensor


class TrainableModel(nn.Module):
    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], param_dtype: torch.dtype = torch.bfloat16,
                 source: str = "the given state dict", kernels: str = "compiled"):
        """`state`: tensors by transformers' names, checked against the architecture's map (a missing,
        stray or misshapen tensor is refused by name); copied into parameters of `param_dtype`. `kernels`: the
        backend whose engine this model is (`compiled`, or `triton`: on CUDA, or CPU under Triton's interpreter);
        parameters live where the inputs will (`.to(device)`)."""
        super().__init__()
        if param_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"parameters are bf16 or fp32 (master weights), not {param_dtype}")
        if config.layer.attention_sinks or config.swiglu:  # no gradient of the sinks, the biased experts
            raise ValueError(f"{config.architecture} is not trainable here: its attention sinks and clamped-SwiGLU "
                             "experts have no backward in margingate.train")
        self.config = config
        self._names = check(config, state, source)
        for parts in self._names.values():
            for name in parts:
                _register(self, name, nn.Parameter(state[name].detach().to(param_dtype).clone()))
        self._rotary, self._local_rotary = rotary_tables(config)
        self.triton = kernels == "triton"
        if kernels not in ("compiled", "triton"):
            raise ValueError(f"unknown kernels {kernels!r} (choose from compiled, triton)")
        if self.triton:
            triton_kernels.require()
        self._ops = kernel_set(self.triton)

    @classmethod
    def from_pretrained(cls, model: str | Path, param_dtype: torch.dtype = torch.bfloat16,
                        kernels: str = "compiled") -> TrainableModel:
        """Any name or path `LLM` takes; the weights as `LLM(model, weights="bf16")` loads them."""
        folder = resolve_model_dir(str(model), tensors=True)
        return cls(load_config(folder), load_state_dict(folder), param_dtype, source=str(folder), kernels=kernels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids [batch, positions]; attention_mask 1 on each sequence's tokens, one run of them per row
        (right or left padding). Returns fp32 logits, the engine's bits at every token position."""
        starts, rows_of = _runs(input_ids, attention_mask)
        dev = input_ids.device
        flat = torch.cat([input_ids[b, a:e] for b, (a, e) in enumerate(rows_of)])
        positions = torch.cat([torch.arange(e - a) for a, e in rows_of]).to(dev)
        W = self.weights()
        h = scale_embedding(self.config, layers.embed(flat, W.embed.plain, torch.bfloat16))
        site = self._attention_site(rows_of, positions, starts)
        full, local = rope_lookup(self._rotary, self._local_rotary, positions, torch.bfloat16)
        for li, L in enumerate(W.layers):
            site.window = self.config.window(li)
            rope = local if site.window else full
            h = decoder_layer(self.config, L, h, self._ops, rope, lambda q, k, v: attention(q, k, v, site))
        logits = self._ops.logits(h, W.norm, W.lm_head, self.config.rms_eps, self.config.layer.norm_mode)
        width = input_ids.shape[1]  # each token's row of the padded [batch * positions] grid, in one copy
        dest = torch.cat([torch.arange(b * width + a, b * width + e) for b, (a, e) in enumerate(rows_of)]).to(dev)
        out = logits.new_zeros(input_ids.numel(), logits.shape[-1]).index_copy(0, dest, logits)
        return CausalLMOutput(out.view(*input_ids.shape, -1))

    def _attention_site(self, rows_of: list[tuple[int, int]], positions: torch.Tensor,
                        starts: list[int]) -> AttentionSite:
        """One exact row per token, each sequence in its own block table of a one-layer pool."""
        cfg, lengths = self.config, [e - a for a, e in rows_of]
        dev = positions.device
        pool = KVPool(1, 1 + sum(blocks_for(n, BLOCK) for n in lengths), BLOCK, cfg.num_kv_heads, cfg.head_dim,
                      device=dev)
        width = max(blocks_for(n, BLOCK) for n in lengths)
        tables = torch.full((len(lengths), width), -1, dtype=torch.long)
        for b, n in enumerate(lengths):
            tables[b, :blocks_for(n, BLOCK)] = torch.tensor([pool.allocate() for _ in range(blocks_for(n, BLOCK))])
        table_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        rows = AttentionRows(AttentionPlan.all_exact(len(positions)), tables.to(dev), table_of.to(dev), positions,
                             triton=self.triton)
        return AttentionSite(rows, pool, starts, cfg.attention_scale)

    def weights(self) -> ModelWeights:
        """The model's weights as the layer reads them, built from the parameters for this forward: each
        matrix a `Param` (q|k|v and gate|up concatenated as the engine fuses them, packed once)."""
        params = dict(self.named_parameters())

        def get(key: str):
            if key not in self._names:
                return None
            parts = [params[n] for n in self._names[key]]
            t = torch.cat(parts) if len(parts) > 1 else parts[0]
            return Param.of(t, self.triton) if key.rsplit(".", 1)[-1] in PACKED or key in ("embed", "lm_head") else t

        def experts(i: int) -> dict:
            if i not in self.config.moe_layers:
                return {}
            return {"router": get(f"layers.{i}.router"), "experts": [
                (get(f"layers.{i}.experts.{e}.gate_up"), get(f"layers.{i}.experts.{e}.down_proj"))
                for e in range(self.config.num_experts)]}

        def layer(i: int) -> LayerWeights:
            return LayerWeights(
                qkv=get(f"layers.{i}.qkv"), qkv_bias=get(f"layers.{i}.qkv.bias"),
                o_proj=get(f"layers.{i}.o_proj"), o_proj_bias=get(f"layers.{i}.o_proj.bias"),
                gate_up=get(f"layers.{i}.gate_up"), down_proj=get(f"layers.{i}.down_proj"),
                input_layernorm=get(f"layers.{i}.input_layernorm"),
                post_attention_layernorm=get(f"layers.{i}.post_attention_layernorm"),
                **{k: get(f"layers.{i}.{k}") for k in EXTRA_LAYER_MAP}, **experts(i))

        embed = get("embed")
        head = embed if self.config.tie_embeddings else get("lm_head")
        return ModelWeights(embed=embed, norm=get("norm"), lm_head=head,
                            layers=[layer(i) for i in range(self.config.num_layers)],
                            experts_per_token=self.config.experts_per_token)


def _register(root: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register `param` under its dotted transformers name, making the modules on its path."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, param)


def _runs(input_ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[list[int], list[tuple[int, int]]]:
    """Each row's run of tokens [a, e) and where it starts among the forward's rows; one run per row."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, positions], got shape {list(input_ids.shape)}")
    if mask is None:
        mask = torch.ones_like(input_ids)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {list(mask.shape)} does not match input_ids {list(input_ids.shape)}")
    rows_of, starts = [], [0]
    for b, row in enumerate(mask.bool()):
        idx = torch.nonzero(row).flatten().tolist()
        if not idx:
            raise ValueError(f"row {b} of attention_mask has no token")
        if idx[-1] - idx[0] + 1 != len(idx):
            raise ValueError(f"row {b} of attention_mask has a gap: one run of tokens per row (right or left padding)")
        rows_of.append((idx[0], idx[-1] + 1))
        starts.append(starts[-1] + len(idx))
    return starts, rows_of
