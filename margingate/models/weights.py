"""The model's weights as a structure: an explicit map from Hugging Face tensor names to ours.

Each of our tensors is one or more Hugging Face tensors concatenated along the output
dimension, in the order the forward splits them again (q|k|v, gate|up). Which tensors a
model needs is decided by its architecture and config (`attention_bias`, `tie_embeddings`),
never guessed from the names a folder happens to hold: a missing tensor, one the forward
would not read, or one of the wrong shape is refused with its name and the folder.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace

import torch

from ..kernels.invariant import expert_set
from ..kernels.packing import PackedWeight, pack
from ..kernels.quant_pack import QuantCodes, QuantWeight, panelable, quant_weight
from . import fused_experts
from .architectures import ARCHITECTURES, EXTRA_LAYER_MAP, IGNORED_SUFFIXES, LAYER_MAP, MODEL_MAP, PARAMETERS
from .config import ModelConfig
from .gguf_quant import GGUFMatrix


class WeightsError(ValueError):
    """A checkpoint's tensors do not match what its config.json says the model is."""


class BlockSource(ABC):
    """A matrix held as GGUF blocks, decoded when the model is built, a run of rows at a time
    (quant_pack.RowSource): a GGUF file's (gguf_quant.GGUFMatrix) or a bf16 one quantized at load
    (quantize.QuantizedAtLoad). `build` keeps it quantized where it can, else uses its dequantized bf16 values."""
    shape: tuple[int, int]
    row_unit: int = 1

    @abstractmethod
    def run(self, start: int, stop: int) -> QuantCodes:
        """Rows [start, stop) (multiples of `row_unit`) decoded (gguf_quant.quant_codes), in Hugging Face row
        order."""

    def codes(self) -> QuantCodes:
        return self.run(0, self.shape[0])

    def bf16(self) -> torch.Tensor:
        return self.codes().bf16()


BlockSource.register(GGUFMatrix)


# packed (or kept quantized) for our kernels, plain for the library's
Matrix = torch.Tensor | PackedWeight | QuantWeight
MATRICES = ("qkv", "o_proj", "gate_up", "down_proj")
PACKED = (*MATRICES, "router")  # our tensors packed for the kernels (an expert's are gate_up and down_proj)


@dataclass
class LayerWeights:
    qkv: Matrix
    qkv_bias: torch.Tensor | None
    o_proj: Matrix
    o_proj_bias: torch.Tensor | None
    gate_up: Matrix
    down_proj: Matrix
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    q_norm: torch.Tensor | None = None  # Gemma 3 (EXTRA_LAYER_MAP)
    k_norm: torch.Tensor | None = None
    pre_feedforward_layernorm: torch.Tensor | None = None
    post_feedforward_layernorm: torch.Tensor | None = None
    router: Matrix | None = None  # an MoE layer (models/moe.py): its gate, and (gate_up, down_proj) per expert
    experts: list[tuple[Matrix, Matrix]] | None = None
    expert_set: object | None = None  # the experts parsed once for the invariant kernels (invariant.expert_set)
    sinks: torch.Tensor | None = None  # gpt-oss: the attention sinks, one logit per query head
    router_bias: torch.Tensor | None = None  # gpt-oss: the router's bias, and (gate_up, down) biases per expert
    expert_biases: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def to(self, dtype: torch.dtype) -> LayerWeights:
        """Plain tensors in `dtype` (packed matrices unpacked)."""
        def pairs(ps):
            return [(_cast(g, dtype), _cast(d, dtype)) for g, d in ps] if ps else None
        return replace(self, **{f.name: _cast(getattr(self, f.name), dtype) for f in fields(self)
                                if f.name not in ("experts", "expert_set", "expert_biases")},
                       experts=pairs(self.experts), expert_biases=pairs(self.expert_biases), expert_set=None)

    def moe_matrices(self) -> list[Matrix]:
        """An MoE layer's router and its experts' matrices (none for a dense layer)."""
        return [self.router, *(m for pair in self.experts for m in pair)] if self.experts else []

    def matrices(self) -> list[Matrix]:
        """Every matrix of the layer (an MoE layer's router and experts in place of its MLP)."""
        return [getattr(self, g) for g in MATRICES if getattr(self, g) is not None] + self.moe_matrices()


@dataclass
class ModelWeights:
    embed: Matrix  # packed only when it is the (tied) head
    norm: torch.Tensor
    lm_head: Matrix  # the embedding matrix itself when the model ties them
    layers: list[LayerWeights]
    experts_per_token: int = 0  # an MoE's top-k (what a decode step reads of its experts)

    @property
    def tied(self) -> bool:
        return self.lm_head is self.embed

    def to(self, dtype: torch.dtype) -> ModelWeights:
        """Plain tensors in `dtype`: a new copy (the library kernels' weights)."""
        embed = _cast(self.embed, dtype)
        return ModelWeights(embed=embed, norm=_cast(self.norm, dtype),
                            lm_head=embed if self.tied else _cast(self.lm_head, dtype),
                            layers=[layer.to(dtype) for layer in self.layers], experts_per_token=self.experts_per_token)


def _cast(t: Matrix | None, dtype: torch.dtype) -> torch.Tensor | None:
    if isinstance(t, (PackedWeight, QuantWeight)):
        t = t.unpack()
    return None if t is None else t.to(dtype)


# --- the map ---------------------------------------------------------------------------------


def _is_matrix(key: str) -> bool:
    """Whether our tensor `key` is a matrix: a linear's weight, the head or the embedding."""
    return key.rsplit(".", 1)[-1] in PACKED or key in ("embed", "lm_head")


def matrix_names(config: ModelConfig) -> list[str]:
    """The Hugging Face names of the model's matrices (what can be kept quantized)."""
    return [n for key, parts in weight_names(config).items() if _is_matrix(key) for n in parts]


def weight_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every tensor the model is made of: our key ("embed", "layers.3.qkv", "layers.3.qkv.bias")
    -> the Hugging Face names it is concatenated from, in order."""
    arch = ARCHITECTURES[config.architecture]
    names = {"embed": (MODEL_MAP["embed"] + ".weight",), "norm": (MODEL_MAP["norm"] + ".weight",)}
    if not config.tie_embeddings:
        names["lm_head"] = (MODEL_MAP["lm_head"] + ".weight",)
    layer_map = LAYER_MAP | {k: EXTRA_LAYER_MAP[k] for k in arch.extra}
    for i in range(config.num_layers):
        moe = arch.moe if i in config.moe_layers else None
        if moe:  # its router and experts in place of the MLP
            names[f"layers.{i}.router"] = (f"model.layers.{i}.{moe.router}.weight",)
            for e in range(config.num_experts):
                base = f"model.layers.{i}.{moe.experts}.{e}."
                names[f"layers.{i}.experts.{e}.gate_up"] = (base + moe.gate + ".weight", base + moe.up + ".weight")
                names[f"layers.{i}.experts.{e}.down_proj"] = (base + moe.down + ".weight",)
                if moe.gpt_oss:
                    names[f"layers.{i}.experts.{e}.gate_up.bias"] = (base + moe.gate + ".bias", base + moe.up + ".bias")
                    names[f"layers.{i}.experts.{e}.down_proj.bias"] = (base + moe.down + ".bias",)
            if moe.gpt_oss:
                names[f"layers.{i}.router.bias"] = (f"model.layers.{i}.{moe.router}.bias",)
        for ours, modules in layer_map.items():
            if moe and ours in ("gate_up", "down_proj"):
                continue
            full = [f"model.layers.{i}.{m}" for m in modules]
            names[f"layers.{i}.{ours}"] = tuple(m if m.endswith(PARAMETERS) else m + ".weight" for m in full)
            if config.attention_bias and ours in arch.biased:
                names[f"layers.{i}.{ours}.bias"] = tuple(m + ".bias" for m in full)
    return names


def expected_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape config.json implies for the Hugging Face tensor `name`."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    module, kind = name.rsplit(".", 1)
    module = module.rsplit(".", 1)[-1]
    if ".experts." in name:  # an expert's gate and up (w1, w3), or its down (w2); gpt-oss: their biases
        moe = config.moe_intermediate
        shape = (hidden, moe) if module in ("down_proj", "w2") else (moe, hidden)
        return shape[:1] if kind == "bias" else shape
    if module in ("gate", "router"):  # an MoE router (gpt-oss's: with a bias)
        return (config.num_experts,) if kind == "bias" else (config.num_experts, hidden)
    if kind == "sinks":
        return (config.num_heads,)
    out, inp = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
                "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
                "embed_tokens": (config.vocab_size, hidden), "lm_head": (config.vocab_size, hidden),
                "q_norm": (config.head_dim, None), "k_norm": (config.head_dim, None),
                }.get(module, (hidden, None))  # the other norms
    return (out,) if kind == "bias" or inp is None else (out, inp)


def _ignored(name: str, config: ModelConfig) -> bool:
    # A tied model's head is the embedding, whatever the folder holds (as transformers ties it).
    return name.endswith(IGNORED_SUFFIXES) or (config.tie_embeddings and name == MODEL_MAP["lm_head"] + ".weight")


def _hint(name: str, config: ModelConfig) -> str:
    if name == MODEL_MAP["lm_head"] + ".weight":
        return "; config.json says tie_word_embeddings is false, so the model needs its own lm_head"
    if name.endswith(tuple(f"{m}.bias" for m in LAYER_MAP["qkv"] + LAYER_MAP["o_proj"])):
        state = "true" if config.attention_bias else "false"
        if ARCHITECTURES[config.architecture].attention_bias is None:
            return f"; attention_bias is {state} in config.json"
        return f"; attention_bias is always {state} for {config.architecture}"
    return ""


def _more(names: list[str]) -> str:
    if len(names) == 1:
        return ""
    return f" (and {len(names) - 1} more: {', '.join(names[1:4])}{', ...' if len(names) > 4 else ''})"


def check(config: ModelConfig, state: dict[str, torch.Tensor], source: str) -> dict[str, tuple[str, ...]]:
    """The name map of `config`, once `state` holds exactly its tensors at their shapes; else WeightsError."""
    names = weight_names(config)
    wanted = [n for parts in names.values() for n in parts]
    missing = [n for n in wanted if n not in state]
    if missing:
        raise WeightsError(f"{missing[0]} missing in {source}{_more(missing)}{_hint(missing[0], config)}")
    wanted_set = set(wanted)
    unexpected = sorted(n for n in state if n not in wanted_set and not _ignored(n, config))
    if unexpected:
        raise WeightsError(f"{unexpected[0]} in {source} is not a weight of this {config.architecture}"
                           f"{_more(unexpected)}{_hint(unexpected[0], config)}")
    for n in wanted:
        if tuple(state[n].shape) != expected_shape(config, n):
            raise WeightsError(f"{n} in {source} has shape {list(state[n].shape)}; "
                               f"config.json implies {list(expected_shape(config, n))}")
    return names


def build(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device,
          source: str = "the given state dict", packed: bool = True) -> ModelWeights:
    """Check `state` against the map, then fuse it into bf16 tensors on `device`, every matrix packed
    (for our C++ kernels; `packed=False`: plain, for the Triton kernels) as soon as it is fused, so
    that memory holds one layer's plain copy at most (the library kernels' plain copy:
    `ModelWeights.to`). A state from a GGUF carries its `packed_cache` (packed_cache.py): each matrix packed
    by an earlier load is mapped from the cache instead of packed again."""
    pack_ = pack if packed else (lambda t: t)
    state = fused_experts.split(config, state)
    names = check(config, state, source)
    # a Checkpoint says how to keep its quantized matrices, or asks for them dequantized (--weights bf16)
    contract = getattr(state, "contract", "int8") if packed and device.type == "cpu" else None
    cache = getattr(state, "packed_cache", None) if contract else None  # the file's matrices packed before

    def keep(key: str, make) -> Matrix:
        return cache.matrix(key, make) if cache is not None else make()

    def get(key: str) -> Matrix | None:
        if key not in names:
            return None
        return keep(key, lambda: fuse(key)) if _is_matrix(key) else fuse(key)

    def fuse(key: str) -> Matrix:
        parts = [state[n] for n in names[key]]
        blocks = all(isinstance(p, BlockSource) for p in parts)  # a GGUF's, or quantized at load
        if blocks and contract and _is_matrix(key) and panelable(parts):
            layouts = [p.run(0, p.row_unit) for p in parts]  # one row unit of each: its code layout
            if contract == "int8" or all(c.exact_form().exact_layout for c in layouts):  # Q2_K..IQ4: int8 only
                return quant_weight(parts, contract)  # decoded and packed a run of rows at a time
        parts = [p.bf16() if isinstance(p, BlockSource) else p for p in parts]
        t = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(device, torch.bfloat16)
        return pack_(t) if key.rsplit(".", 1)[-1] in PACKED else t

    def experts(i: int) -> dict:
        if i not in config.moe_layers:
            return {}
        pairs = [(get(f"layers.{i}.experts.{e}.gate_up"), get(f"layers.{i}.experts.{e}.down_proj"))
                 for e in range(config.num_experts)]
        own = packed and device.type == "cpu"  # our C++ kernels' weights: the experts parsed once for them
        biased, extra = _gpt_oss_biases(config, i, get) if config.swiglu else ({}, None)
        return {"router": get(f"layers.{i}.router"), "experts": pairs, **biased,
                "expert_set": expert_set(pairs, config.experts_per_token, config.norm_topk, extra) if own else None}

    embed = get("embed")
    layers = [LayerWeights(
        qkv=get(f"layers.{i}.qkv"), qkv_bias=get(f"layers.{i}.qkv.bias"),
        o_proj=get(f"layers.{i}.o_proj"), o_proj_bias=get(f"layers.{i}.o_proj.bias"),
        gate_up=get(f"layers.{i}.gate_up"), down_proj=get(f"layers.{i}.down_proj"),
        input_layernorm=get(f"layers.{i}.input_layernorm"),
        post_attention_layernorm=get(f"layers.{i}.post_attention_layernorm"),
        **{k: get(f"layers.{i}.{k}") for k in EXTRA_LAYER_MAP}, **experts(i),
    ) for i in range(config.num_layers)]
    lm_head = embed if config.tie_embeddings else get("lm_head")
    lm_head = lm_head if isinstance(lm_head, QuantWeight) else keep("lm_head.packed", lambda: pack_(lm_head))
    if config.tie_embeddings:  # a tied model's embedding rows are read from its packed head
        embed = lm_head
    if cache is not None:
        cache.save()
    return ModelWeights(embed=embed, norm=get("norm"), lm_head=lm_head, layers=layers,
                        experts_per_token=config.experts_per_token)


def _gpt_oss_biases(config: ModelConfig, i: int, get) -> tuple[dict, tuple]:
    """Layer i's router bias and each expert's (gate_up, down) biases (gpt-oss), as LayerWeights fields, and as
    `invariant.expert_set` takes them with the SwiGLU's (alpha, limit)."""
    router = get(f"layers.{i}.router.bias")
    experts = [(get(f"layers.{i}.experts.{e}.gate_up.bias"), get(f"layers.{i}.experts.{e}.down_proj.bias"))
               for e in range(config.num_experts)]
    return {"router_bias": router, "expert_biases": experts}, (experts, router, config.swiglu)


def streamed_bytes(weights: ModelWeights) -> int:
    """The bytes a decode step reads for the linears and the head, as stored (bf16, or kept quantized)."""
    def size(m) -> int:
        return m.data.numel() if isinstance(m, QuantWeight) else 2 * m.shape[0] * m.shape[-1]

    def layer(L: LayerWeights) -> float:  # an MoE layer reads its router and, per row, k of its experts
        dense = sum(size(getattr(L, g)) for g in MATRICES if getattr(L, g) is not None)
        if not L.experts:
            return dense
        share = weights.experts_per_token / len(L.experts)
        return dense + size(L.router) + share * sum(size(m) for pair in L.experts for m in pair)
    return int(sum(layer(L) for L in weights.layers)) + size(weights.lm_head)


def quantized_contract(weights: ModelWeights) -> str | None:
    """The contract the kept-quantized matrices run under ("int8" or "exact"; "int8+exact" never happens
    from one load), or None where every matrix is bf16: what the reports and /health name."""
    ms = [m for L in weights.layers for m in L.matrices()] + [weights.lm_head]
    found = dict.fromkeys(m.contract for m in ms if isinstance(m, QuantWeight))
    return "+".join(found) or None


def weight_formats(weights: ModelWeights) -> dict[str, str]:
    """Each matrix group's storage ("bf16", or the GGUF types kept quantized, "q4_k+q6_k" where a
    fused matrix or the layers mix them): what the reports name."""
    def kinds(ms) -> str:
        found = dict.fromkeys(f for m in ms for f in (m.formats if isinstance(m, QuantWeight) else ("bf16",)))
        return "+".join(found)
    groups = {g: [getattr(L, g) for L in weights.layers if getattr(L, g) is not None] for g in MATRICES}
    groups = {g: ms for g, ms in groups.items() if ms}  # an all-MoE model has no dense gate_up or down_proj
    experts = [m for L in weights.layers for m in L.moe_matrices()]
    if experts:
        groups["experts"] = experts
    return {**{g: kinds(ms) for g, ms in groups.items()}, "lm_head": kinds([weights.lm_head]),
            "embed": kinds([weights.embed])}
