"""POST /v1/embeddings (OpenAI's API); the app that serves embedding models alone is server/embedding_app.py.

Two ways to serve them (docs/serving.md, "Embeddings"):
- beside a chat model (`margingate serve --embedding-model all-minilm-l6-v2`): the chat app answers
  /v1/embeddings for each `--embedding-model` by its name, and for the chat model's own name with the
  decoder's pooled hidden states; `create_app(..., embeddings=EmbeddingModels(...))` hands them in;
- alone (`margingate serve --model all-minilm-l6-v2`): `create_embedding_app`, which answers
  /v1/embeddings, /v1/models and /health, and says on the generation routes that it serves embeddings only.

A request's `input` is a string, a list of strings, a list of token ids, or a list of such lists;
`encoding_format` float or base64 (little-endian fp32, as the openai SDK decodes it); `dimensions` where the
model is trained for truncation (else a 400 naming the model's size). Every vector is the same bits whether
its text came alone or among others, at any thread count (margingate/embeddings). One forward per model at a
time (the kernels use every core).
"""
from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass, field

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from starlette.concurrency import run_in_threadpool

from ...embeddings.embedder import Embedder
from ...errors import OptionError
from ..protocol.errors import json_error

router = APIRouter()
FORMATS = ("float", "base64")


@dataclass
class EmbeddingModels:
    """The embedders an app serves, by the name a client gives as `model` (the first is the default when a
    body names none)."""
    embedders: dict[str, Embedder]
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.locks = {name: threading.Lock() for name in self.embedders}

    def cards(self) -> list[dict]:
        return [{"id": name, "object": "model", "created": self.created, "owned_by": "margingate",
                 "type": "embedding", "embedding": {"dimensions": e.dimension, "max_input_tokens": e.max_tokens,
                                                    "pooling": e.pooling, "normalized": e.normalize,
                                                    "truncatable": e.matryoshka, "kind": e.kind}}
                for name, e in self.embedders.items()]

    def run(self, name: str, inputs, dimensions: int | None):
        with self.locks[name]:
            return self.embedders[name].embed(inputs, dimensions)


def _vector(values, encoding: str):
    if encoding == "base64":
        return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode()
    return values.tolist()


def parse(body) -> tuple[str | None, object, str, int | None]:
    """(model, input, encoding_format, dimensions) of a body, or OptionError naming the field."""
    if not isinstance(body, dict):
        raise OptionError("body", "the body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise OptionError("model", "model must be a string")
    if "input" not in body:
        raise OptionError("input", "input is required: a string, a list of strings, a list of token ids or a list "
                                   "of such lists")
    inputs = body["input"]
    inputs = [inputs] if isinstance(inputs, str) else inputs
    if isinstance(inputs, list) and inputs and all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
        inputs = [inputs]  # one text's token ids
    if not isinstance(inputs, list) or not all(isinstance(x, (str, list)) for x in inputs):
        raise OptionError("input", "input must be a string, a list of strings, a list of token ids or a list of "
                                   "such lists")
    encoding = body.get("encoding_format") or "float"
    if encoding not in FORMATS:
        raise OptionError("encoding_format", f"encoding_format must be one of {', '.join(FORMATS)}, got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1):
        raise OptionError("dimensions", f"dimensions must be a positive integer, got {dimensions!r}")
    return model, inputs, encoding, dimensions


@router.post("/v1/embeddings")
async def create_embeddings(req: HTTPRequest):
    models: EmbeddingModels | None = getattr(req.app.state, "embeddings", None)
    if models is None or not models.embedders:
        return json_error(400, "this server serves no embedding model: start it with `margingate serve "
                               "--embedding-model all-minilm-l6-v2` (or another)", param="model")
    try:
        body = await req.json()
    except ValueError:
        return json_error(400, "the body is not valid JSON")
    try:
        model, inputs, encoding, dimensions = parse(body)
        name = model or next(iter(models.embedders))
        if name not in models.embedders:
            return json_error(404, f"the embedding model {name!r} does not exist; this server embeds with "
                                   f"{', '.join(map(repr, models.embedders))}", param="model", code="model_not_found")
        result = await run_in_threadpool(models.run, name, inputs, dimensions)
    except OptionError as exc:
        return json_error(400, str(exc), param=exc.option)
    data = [{"object": "embedding", "index": i, "embedding": _vector(v, encoding)}
            for i, v in enumerate(result.vectors)]
    return {"object": "list", "data": data, "model": name,
            "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens}}
