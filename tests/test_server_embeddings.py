"""POST /v1/embeddings on the app that serves an embedding model alone, over a small random BERT (in process:
Starlette's test client, which the openai SDK and LangChain take as their HTTP client): every input shape and
encoding, usage, the refusals, the same vector alone and in a batch through HTTP, and the clients reading it.
A real uvicorn beside a chat model, on the real models: test_embeddings_real.py (slow)."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the server needs its extra: pip install 'margingate[server]'")
from starlette.testclient import TestClient  # noqa: E402
from test_embeddings import embedder, random_encoder  # noqa: E402

from margingate.server.api.embeddings import EmbeddingModels  # noqa: E402
from margingate.server.core.config import ServerConfig  # noqa: E402
from margingate.server.embedding_app import create_embedding_app  # noqa: E402


class Words:
    """A stand-in tokenizer: each word's hash into the vocabulary (the HTTP layer only needs ids)."""

    def encode(self, text: str):
        ids = [1, *(3 + sum(map(ord, w)) % 100 for w in text.split()), 2]
        return type("Encoding", (), {"ids": ids})()


@pytest.fixture(scope="module")
def tiny():
    e = embedder(random_encoder("bert")[0])
    e.tokenizer = Words()
    return e


@pytest.fixture(scope="module")
def client(tiny):
    app = create_embedding_app(EmbeddingModels({"tiny": tiny}), ServerConfig(api_key="k"))
    with TestClient(app, headers={"Authorization": "Bearer k"}) as c:
        yield c


def post(client, **body):
    return client.post("/v1/embeddings", json={"model": "tiny", **body})


def test_every_input_shape_and_encoding_gives_the_same_bits(client, tiny):
    want = tiny.embed(["a b c", "d e"]).vectors
    ids = [tiny.tokenize("a b c"), tiny.tokenize("d e")]
    for body in ({"input": ["a b c", "d e"]}, {"input": ids}, {"input": ["a b c", "d e"], "encoding_format": "base64"}):
        r = post(client, **body)
        assert r.status_code == 200, r.text
        got = r.json()
        vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if isinstance(d["embedding"], str)
                   else np.array(d["embedding"], dtype=np.float32) for d in got["data"]]
        assert [d["index"] for d in got["data"]] == [0, 1] and got["object"] == "list" and got["model"] == "tiny"
        assert all(np.array_equal(v, w.numpy()) for v, w in zip(vectors, want))
        assert got["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    one = post(client, input="d e").json()["data"]
    assert len(one) == 1 and one[0]["embedding"] == want[1].tolist()  # alone = in a batch, through HTTP
    assert post(client, input=ids[1]).json()["data"][0]["embedding"] == want[1].tolist()  # one list of ids


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "dimensions": 8}, 400, "dimensions"), ({"input": []}, 400, "input"),
    ({"input": [[1, 10_000]]}, 400, "input"), ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "model": "other"}, 404, "model"), ({}, 400, "input"), ({"input": [1.5]}, 400, "input")])
def test_refusals_name_the_field(client, body, status, param):
    r = client.post("/v1/embeddings", json={"model": "tiny", **body})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_the_embedding_only_app_lists_its_model_and_refuses_generation_by_name(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["embedding"]["dimensions"] == 64
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and "embedding models only" in r.json()["error"]["message"]
    assert client.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer no"}).status_code == 401


@pytest.mark.slow  # LangChain's import alone takes seconds
def test_the_openai_sdk_and_langchain_read_our_vectors(client, tiny):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client)
    got = sdk.embeddings.create(model="tiny", input=["a b c", "d e"])  # the SDK asks for base64 and decodes it
    want = tiny.embed(["a b c", "d e"]).vectors
    assert [np.float32(x) for x in got.data[1].embedding] == list(want[1].numpy()) and got.usage.prompt_tokens == 9
    lc = pytest.importorskip("langchain_openai", reason="pip install langchain-openai")
    emb = lc.OpenAIEmbeddings(model="tiny", base_url="http://testserver/v1", api_key="k", http_client=client,
                              check_embedding_ctx_length=False)  # else it sends tiktoken's ids, not our vocabulary
    assert torch.equal(torch.tensor(emb.embed_documents(["a b c", "d e"]), dtype=torch.float32), want)
    assert torch.equal(torch.tensor(emb.embed_query("d e"), dtype=torch.float32), want[1])
