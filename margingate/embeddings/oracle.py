"""The oracle for an encoder: transformers' own class (BertModel, NomicBertModel) on the same weights, mean /
cls pooled and L2-normed by hand as sentence-transformers does; tests and results/embeddings/ read it. "The
same weights" are the bf16 values our encoder holds (matrices and LayerNorm weights rounded once, biases and
tables as the file has them); `as_file=True` keeps the file's own values instead (fp32 or F16), to show what the
bf16 rounding of the weights costs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .encoder import EncoderConfig
from .files import EncoderFiles


def rounded_like_ours(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Matrices (not the embedding tables) and LayerNorm weights rounded to bf16, back in fp32."""
    def ours(name: str, v: torch.Tensor) -> bool:
        return (v.dim() == 2 and "embeddings" not in name) or name.endswith(("LayerNorm.weight", "layernorm.weight"))
    return {k: v.to(torch.bfloat16).float() if ours(k, v) else v.float() for k, v in state.items()}


def transformers_model(files: EncoderFiles, as_file: bool = False, dtype: torch.dtype = torch.float32):
    """transformers' model of `files` (eval, in `dtype`) on our weights or, `as_file`, on the file's."""
    from transformers import BertConfig, BertModel, NomicBertConfig, NomicBertModel

    c: EncoderConfig = files.config
    common = dict(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.layers, num_attention_heads=c.heads,
                  intermediate_size=c.intermediate, max_position_embeddings=c.max_positions, layer_norm_eps=c.eps)
    if c.arch == "bert":
        model = BertModel(BertConfig(**common), add_pooling_layer=False)
    else:
        model = NomicBertModel(NomicBertConfig(**common, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": c.rope_theta}))
    state = {k: v.float() for k, v in files.state.items()} if as_file else rounded_like_ours(files.state)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    return model.eval().to(dtype)


@torch.inference_mode()
def oracle_vectors(model, texts: list[list[int]], pooling: str = "mean", normalize: bool = True,
                   batch: int = 8) -> torch.Tensor:
    """The pooled, normed last hidden state of each text, fp32: texts right-padded in batches of `batch`, the
    padding masked out of attention and of the pooling (as sentence-transformers runs them)."""
    out = []
    for i in range(0, len(texts), batch):
        group = texts[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([t + [0] * (width - len(t)) for t in group])
        mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in group])
        h = model(ids, attention_mask=mask).last_hidden_state.float()
        lengths = mask.sum(1)
        v = {"mean": lambda: (h * mask[..., None]).sum(1) / lengths[:, None], "cls": lambda: h[:, 0],
             "last": lambda: h[torch.arange(len(group)), lengths - 1]}[pooling]()
        out.append(F.normalize(v, dim=-1) if normalize else v)
    return torch.cat(out)
