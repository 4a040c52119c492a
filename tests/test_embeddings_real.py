"""The real embedding models (slow tier): all-MiniLM-L6-v2 and nomic-embed-text-v1.5 from the packages pip puts
them in (each test skips naming the install command), and the embedded SmolLM2 as a decoder embedder. Each
against transformers on the same weights (cosine >= 0.9999 in fp32 activations), the same bits alone and in a
batch of 32, and served: the openai SDK and LangChain's OpenAIEmbeddings read vectors from a real server that
also serves chat."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from margingate.data.prompts import builtin_prompts
from margingate.embeddings import files_of, load, sources
from margingate.embeddings.oracle import oracle_vectors, transformers_model

pytestmark = pytest.mark.slow
TEXTS = [p.text or p.messages[-1]["content"] for p in builtin_prompts()][:32]


def installed(name: str):
    if not sources.installed(name):
        pytest.skip(f"{name} is not installed: {sources.NAMED[name].install}")


@pytest.fixture(scope="module", params=list(sources.NAMED))
def named(request):
    installed(request.param)
    return request.param, files_of(request.param), load(request.param)


def test_a_real_model_matches_transformers_and_gives_the_same_bits_alone_and_in_a_batch(named):
    name, files, embedder = named
    ids = [embedder.tokenize(t) for t in TEXTS]
    batched = embedder.embed(ids).vectors
    for i in (0, 7, 31):
        assert torch.equal(embedder.embed([ids[i]]).vectors[0], batched[i])
    want = oracle_vectors(transformers_model(files), ids, files.pooling, files.normalize)
    cosine = F.cosine_similarity(batched, want, dim=-1)
    assert cosine.min() >= 0.9999, f"{name}: {cosine.min():.6f}"


def test_the_gguf_vocabulary_tokenizes_as_bert_base_uncased():
    """nomic's GGUF vocabulary, turned back into WordPiece, gives the ids of MiniLM's tokenizer.json (the same
    bert-base-uncased vocabulary) on text with accents, CJK, punctuation and capitals."""
    for name in sources.NAMED:
        installed(name)
    nomic, minilm = files_of("nomic-embed-text-v1.5").tokenizer, files_of("all-minilm-l6-v2").tokenizer
    for text in [*TEXTS, "Héllo Wörld, naïve café: 東京 ☃ don't STOP!", "search_query: What is TSNE?"]:
        assert nomic.encode(text).ids == minilm.encode(text).ids


def test_a_decoder_embeds_with_its_final_hidden_state(exact_llm, model_dir):
    """SmolLM2, last-token pooling: transformers' normed last hidden state (fp32, the same bf16 weights)."""
    import transformers

    from margingate.embeddings.embedder import DecoderEmbedder

    e = DecoderEmbedder("smollm2-135m", exact_llm.model, exact_llm.tokenizer, pooling="last")
    ids = [e.tokenize(t) for t in TEXTS[:8]]
    batched = e.embed(ids).vectors
    assert torch.equal(e.embed([ids[3]]).vectors[0], batched[3])
    hf = transformers.LlamaModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([F.normalize(hf(torch.tensor([t])).last_hidden_state[0, -1], dim=0) for t in ids])
    assert F.cosine_similarity(batched, want, dim=-1).min() >= 0.9999


def test_clients_read_vectors_from_a_server_that_also_serves_chat(llm):
    installed("all-minilm-l6-v2")
    openai = pytest.importorskip("openai")
    from server_fixtures import make_server

    from margingate.embeddings.embedder import DecoderEmbedder
    from margingate.server.api.embeddings import EmbeddingModels

    minilm = load("all-minilm-l6-v2")
    own = DecoderEmbedder("smollm2-135m", llm.model, llm.tokenizer)
    srv = make_server(llm, slots=2, embeddings=EmbeddingModels({"smollm2-135m": own, "all-minilm-l6-v2": minilm}))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[:4])
        want = minilm.embed(TEXTS[:4]).vectors
        assert torch.equal(torch.tensor([d.embedding for d in got.data]), want)
        own_vec = client.embeddings.create(model="smollm2-135m", input=TEXTS[0], encoding_format="float")
        assert torch.equal(torch.tensor(own_vec.data[0].embedding), own.embed(TEXTS[:1]).vectors[0])
        lc = pytest.importorskip("langchain_openai", reason="pip install langchain-openai")
        emb = lc.OpenAIEmbeddings(model="all-minilm-l6-v2", base_url=f"{srv.url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False)
        assert torch.equal(torch.tensor(emb.embed_documents(TEXTS[:4]), dtype=torch.float32), want)
        chat = client.chat.completions.create(model="smollm2-135m", max_tokens=4,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].message.content is not None
        listed = {m.id for m in client.models.list().data}
        assert listed == {"smollm2-135m", "all-minilm-l6-v2"}
    finally:
        srv.stop()
