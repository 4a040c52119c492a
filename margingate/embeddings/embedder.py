"""Texts (or token ids) in, one vector per text out, the same bits whatever else is embedded with it.

An `Embedder` runs a model's forward over texts laid one after another (no padding: each text's rows see
only its own keys), pools each text's token states (`mean`, `cls` or `last`, as the model's files say),
then normalizes (L2) where the model does. `dimensions` truncates a Matryoshka-trained model
(nomic-embed-text-v1.5, as its model card does it: LayerNorm without affine over the pooled vector, the first
`dimensions` values, L2); any other model takes only its own size. Every step is an invariant kernel
(`kernels/encoder.py`), so a text's vector is the same bits alone, in any batch, at any thread count.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import OptionError
from ..kernels import encoder as ops
from .encoder import EncoderModel

Inputs = Sequence[str] | Sequence[Sequence[int]]
MATRYOSHKA_EPS = 1e-5  # F.layer_norm's default, as nomic's recipe calls it


@dataclass(frozen=True)
class Embedded:
    vectors: torch.Tensor  # [texts, dimensions] fp32
    tokens: int  # input tokens in all (usage)


class Embedder:
    """The shared part: validation, batching, pooling, the finish. Subclasses give `tokenize` and `hidden`."""

    kind = "?"

    def __init__(self, name: str, *, dimension: int, max_tokens: int, vocab: int, pooling: str, normalize: bool,
                 matryoshka: bool = False, dtype: torch.dtype = torch.float32, batch_tokens: int = 8192):
        if pooling not in ("mean", "cls", "last"):
            raise ValueError(f"pooling must be mean, cls or last, got {pooling!r}")
        self.name, self.dimension, self.max_tokens, self.vocab = name, dimension, max_tokens, vocab
        self.pooling, self.normalize, self.matryoshka, self.dtype = pooling, normalize, matryoshka, dtype
        self.batch_tokens = batch_tokens  # rows per forward (memory only: no bit depends on it)

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def hidden(self, texts: list[list[int]]) -> torch.Tensor:
        """The last layer's token states [sum of lengths, dimension] of texts laid one after another."""
        raise NotImplementedError

    def embed(self, inputs: Inputs, dimensions: int | None = None) -> Embedded:
        """One vector per input: strings are tokenized with the model's special tokens; lists of ints are
        taken as token ids as they are. OptionError (param `input` or `dimensions`) for what cannot be
        embedded: nothing, an empty text, too many tokens, an id outside the vocabulary."""
        self.check_dimensions(dimensions)
        texts = self.token_lists(inputs)
        pooled = torch.cat([self._pool(batch) for batch in self._batches(texts)])
        return Embedded(self.finish(pooled, dimensions), sum(map(len, texts)))

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if self.matryoshka and not 1 <= dimensions <= self.dimension:
            raise OptionError("dimensions", f"dimensions must be in 1..{self.dimension} for {self.name}, "
                                            f"got {dimensions}")
        if not self.matryoshka and dimensions != self.dimension:
            raise OptionError("dimensions", f"{self.name} does not support `dimensions` (it is not trained for "
                                            f"truncation): omit it, or pass its size {self.dimension}")

    def token_lists(self, inputs: Inputs) -> list[list[int]]:
        if isinstance(inputs, str) or not isinstance(inputs, Sequence) or not inputs:
            raise OptionError("input", "input must be a string, a list of strings, a list of token ids or a "
                                       "list of such lists, and not empty")
        texts = [self.tokenize(x) if isinstance(x, str) else list(x) for x in inputs]
        for i, ids in enumerate(texts):
            if not ids:
                raise OptionError("input", f"input[{i}] is empty: it has no tokens to embed")
            if len(ids) > self.max_tokens:
                raise OptionError("input", f"input[{i}] has {len(ids)} tokens; {self.name} takes at most "
                                           f"{self.max_tokens}: shorten it")
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab),
                       None)
            if bad is not None:
                raise OptionError("input", f"input[{i}] holds {bad!r}, not a token id of {self.name} "
                                           f"(0..{self.vocab - 1})")
        return texts

    def _batches(self, texts: list[list[int]]):
        batch, size = [], 0
        for ids in texts:
            if batch and size + len(ids) > self.batch_tokens:
                yield batch
                batch, size = [], 0
            batch.append(ids)
            size += len(ids)
        yield batch

    def _pool(self, texts: list[list[int]]) -> torch.Tensor:
        """[texts, dimension] fp32: each text's token states pooled."""
        h, lengths = self.hidden(texts), [len(t) for t in texts]
        ends = torch.tensor(lengths).cumsum(0)
        if self.pooling == "cls":
            return h[ends - torch.tensor(lengths)].float()
        if self.pooling == "last":
            return h[ends - 1].float()
        return ops.pooled_sum(h, lengths) / torch.tensor(lengths, dtype=torch.float32)[:, None]

    def finish(self, pooled: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        if dimensions is not None and self.matryoshka:
            ones = torch.ones(self.dimension, dtype=torch.bfloat16)
            return ops.l2_normalize(ops.layer_norm(pooled, ones, None, MATRYOSHKA_EPS)[:, :dimensions])
        return ops.l2_normalize(pooled) if self.normalize else pooled


class EncoderEmbedder(Embedder):
    """A BERT-family encoder (`embeddings/encoder.py`) and its WordPiece tokenizer."""

    kind = "encoder"

    def __init__(self, name: str, model: EncoderModel, tokenizer, *, pooling: str, normalize: bool, max_tokens: int,
                 matryoshka: bool = False, dtype: torch.dtype = torch.float32):
        cfg = model.config
        super().__init__(name, dimension=cfg.hidden, max_tokens=max_tokens, vocab=cfg.vocab, pooling=pooling,
                         normalize=normalize, matryoshka=matryoshka, dtype=dtype)
        self.model, self.tokenizer = model, tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def hidden(self, texts: list[list[int]]) -> torch.Tensor:
        return self.model.forward(texts, self.dtype)


class DecoderEmbedder(Embedder):
    """A decoder the engine runs (`models/decoder.py`): its final normed hidden states, each text's rows
    attending exactly over their own causal prefix (the engine's prompt path), in a cache of its own."""

    kind = "decoder"
    BLOCK = 16  # cache positions per block (memory only)

    def __init__(self, name: str, model, tokenizer, *, pooling: str = "last", normalize: bool = True,
                 max_tokens: int = 2048, dtype: torch.dtype = torch.float32):
        cfg = model.config
        super().__init__(name, dimension=cfg.hidden_size, max_tokens=max_tokens, vocab=cfg.vocab_size,
                         pooling=pooling, normalize=normalize, dtype=dtype, batch_tokens=2048)
        self.model, self.tokenizer = model, tokenizer  # tokenizer: the model's (models/tokenizer.py)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def hidden(self, texts: list[list[int]]) -> torch.Tensor:
        from ..kernels.attention import AttentionPlan
        from ..models.kv_cache import KVPool

        cfg, lengths = self.model.config, [len(t) for t in texts]
        widths = [math.ceil(n / self.BLOCK) for n in lengths]
        pool = KVPool(cfg.num_layers, sum(widths), self.BLOCK, cfg.num_kv_heads, cfg.head_dim,
                      dtype="float32" if self.dtype == torch.float32 else "bfloat16")
        tables = torch.full((len(texts), max(widths)), -1, dtype=torch.long)
        first = 0
        for i, w in enumerate(widths):
            tables[i, :w] = torch.arange(first, first + w)
            first += w
        table_of = torch.repeat_interleave(torch.arange(len(texts)), torch.tensor(lengths))
        positions = torch.cat([torch.arange(n) for n in lengths])
        tokens = torch.tensor([t for ids in texts for t in ids], dtype=torch.long)
        return self.model.final_hidden(tokens, positions, tables, table_of, AttentionPlan.all_exact(len(tokens)),
                                       pool, dtype=self.dtype)
