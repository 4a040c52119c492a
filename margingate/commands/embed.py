"""`margingate embed`: one vector per text, as JSON lines (registered in margingate/cli.py).

    margingate embed --model all-minilm-l6-v2 "first text" "second text"
    margingate embed --model nomic-embed-text-v1.5 --file texts.txt --dimensions 256   # one text per line

An encoder (`embeddings.is_embedding_model`) or any decoder the engine runs (pooled as its files say:
`embeddings.decoder_pooling`). Each line: {"index", "tokens", "embedding"}; the same text gives the same
bits in any batch and at any thread count.
"""
from __future__ import annotations

import json
import sys

from .. import cli_args

DTYPES = ("float32", "bfloat16")


def add_parser(sub) -> None:
    p = sub.add_parser("embed", help="embed texts (one vector each, JSON lines); batch-invariant")
    p.add_argument("texts", nargs="*", help="the texts (or --file)")
    p.add_argument("--file", default=None, help="a file of texts, one per line ('-': standard input)")
    p.add_argument("--model", default="all-minilm-l6-v2",
                   help="an embedding model (all-minilm-l6-v2, nomic-embed-text-v1.5, an encoder's folder or GGUF) "
                        "or a decoder model (pooled last-token unless its files say otherwise)")
    p.add_argument("--dimensions", type=cli_args.positive_int, default=None,
                   help="truncate to N values (Matryoshka models only: nomic-embed-text-v1.5)")
    add_dtype_arg(p, "--dtype")
    p.add_argument("--threads", type=cli_args.positive_int, default=None,
                   help="torch CPU threads (default: all cores; the vectors do not depend on it)")
    p.set_defaults(func=cmd_embed)


def add_dtype_arg(p, flag: str) -> None:
    p.add_argument(flag, default="float32", choices=DTYPES,
                   help="the activations' dtype (default float32: the oracle's cosine >= 0.9999; bfloat16 is faster)")


def embedder_for(model: str, dtype: str, llm=None):
    """The embedder of `model`: an encoder loaded by name or path, or the decoder of `llm` (loaded here when
    not given) with the pooling its files name."""
    import torch

    from ..embeddings import decoder_pooling, is_embedding_model, load
    from ..embeddings.embedder import DecoderEmbedder
    from ..models.loader import gguf_parts

    torch_dtype = getattr(torch, dtype)
    if is_embedding_model(model):
        return load(model, torch_dtype)
    if llm is None:
        from ..llm import LLM

        llm = LLM(model, max_num_seqs=1, weights="exact")
    return DecoderEmbedder(model, llm.model, llm.tokenizer, pooling=decoder_pooling(llm.folder, gguf_parts(model)),
                           max_tokens=llm.engine.max_len, dtype=torch_dtype)


def read_texts(args) -> list[str]:
    texts = list(args.texts)
    if args.file:
        stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
        with stream:
            texts += [line.rstrip("\n") for line in stream if line.strip()]
    if not texts:
        raise ValueError("no texts: give them as arguments or with --file")
    return texts


def cmd_embed(args) -> None:
    texts = read_texts(args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    embedder = embedder_for(args.model, args.dtype)
    tokens = [embedder.tokenize(t) for t in texts]
    vectors = embedder.embed(tokens, args.dimensions).vectors
    for i, (ids, v) in enumerate(zip(tokens, vectors)):
        print(json.dumps({"index": i, "tokens": len(ids), "embedding": v.tolist()}))
