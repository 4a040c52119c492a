"""One architecture's decoder layer, stated once.

Every decoder layer is the same sequence: norm, q/k/v projection, (q/k norms), RoPE, attention, output
projection, residual add, norm, MLP (dense or a mixture of experts), residual add. What an architecture
changes is a handful of switches, listed here. Both forwards read them: the Python layer path
(`models/decoder.py`: fp32 and library kernels, Triton) and the compiled stack (`csrc/stack.cpp`, through
`invariant.stack_spec`), so they cannot disagree. The per-model numbers that go with a layer (biases,
RoPE base and scaling, sliding windows, experts, the experts' activation) come from the model's config.

Adding an architecture is one `LayerSpec` (in `models/architectures.py`) plus its config mapping; a
switch that no existing one covers is a field here, in the Python layer, and in the stack.
"""
from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    unit_offset_norms: bool = False  # every RMSNorm scales by (1 + w) in fp32 (Gemma), else by w
    qk_norm: bool = False            # q and k RMS-normed per head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False     # attention and MLP outputs normed before their residual adds, the MLP's
    #                                  input by its own pre-FFN norm (Gemma 3: post_attention_layernorm norms the
    #                                  attention's output, where the Llama family's norms the MLP's input)
    activation: str = "silu"         # the MLP's gate activation (one of ACTIVATIONS)
    embed_scale: bool = False        # embeddings times sqrt(hidden), that factor rounded to the activations' dtype
    attention_sinks: bool = False    # a learned logit per query head joins the softmax's denominator (gpt-oss)
    fp32_norm_product: bool = False  # every RMSNorm multiplies the fp32 normed row by w in fp32, rounds once
    #                                  (gpt-oss), where the Llama family rounds the normed row first

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r} (choose from {', '.join(ACTIVATIONS)})")

    @property
    def norm_mode(self) -> int:
        """How a norm's row meets its weight, as the kernels' rmsnorm takes it: 0 the Llama family's (the normed
        row rounded, then times w), 1 (1 + w) in fp32 (Gemma), 2 w in fp32 (gpt-oss); each rounded once after."""
        return 1 if self.unit_offset_norms else 2 if self.fp32_norm_product else 0

    @property
    def extra_norms(self) -> tuple[str, ...]:
        """The layer's norms beyond the Llama family's two (input_layernorm, post_attention_layernorm)."""
        return (("q_norm", "k_norm") if self.qk_norm else ()) + (
            ("pre_feedforward_layernorm", "post_feedforward_layernorm") if self.sandwich_norms else ())
