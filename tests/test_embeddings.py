"""Embeddings on small random-weight encoders (BERT and nomic-bert, built by transformers' own classes, which
are the oracle): a text's vector is the same bits alone, in any batch and at any thread count; it matches
transformers (cosine >= 0.9999 with fp32 activations on the same bf16 weights); the kernels it is made of
follow their stated math; bad inputs are refused by name. The real models: test_embeddings_real.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from margingate.embeddings.embedder import EncoderEmbedder
from margingate.embeddings.encoder import EncoderConfig, EncoderModel
from margingate.errors import OptionError
from margingate.kernels import encoder as ops

VOCAB = 120
TEXTS = [[1, 5, 9, 33, 2], [1, 7, 2], [1, *range(10, 80), 2], [1, 44, 45, 46, 47, 48, 2], [1, 2]]


def bf16_weights(state: dict) -> dict:
    """What our encoder holds: matrices and LayerNorm weights rounded to bf16 (biases, tables as they are)."""
    return {k: v.to(torch.bfloat16).float() if (v.dim() == 2 and "embeddings" not in k) or
            k.endswith(("LayerNorm.weight", "layernorm.weight")) else v for k, v in state.items()}


def random_encoder(arch: str, seed: int = 0):
    """(our EncoderModel, transformers' model on the same bf16 weights), hidden 64, 2 layers, 4 heads."""
    from transformers import BertConfig, BertModel, NomicBertConfig, NomicBertModel

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=128)
    if arch == "bert":
        hf = BertModel(BertConfig(**common), add_pooling_layer=False)
    else:
        hf = NomicBertModel(NomicBertConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}))
    with torch.no_grad():  # LayerNorms away from (1, 0), so that their weights and biases are tested too
        for name, p in hf.named_parameters():
            if name.endswith(("LayerNorm.weight", "layernorm.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    state = {k: v.clone() for k, v in hf.state_dict().items() if "position_ids" not in k}
    hf.load_state_dict(bf16_weights(state), strict=False)
    raw = hf.config.to_dict()
    return EncoderModel(EncoderConfig.from_hf(raw), state), hf.eval()


@pytest.fixture(scope="module", params=["bert", "nomic-bert"])
def encoder(request):
    return random_encoder(request.param)


def embedder(model: EncoderModel, dtype=torch.float32, **kw) -> EncoderEmbedder:
    kw.setdefault("pooling", "mean")
    kw.setdefault("normalize", True)
    return EncoderEmbedder("tiny", model, None, max_tokens=100, dtype=dtype, **kw)


def test_a_text_gives_the_same_bits_alone_in_any_batch_and_at_any_thread_count(encoder):
    e = embedder(encoder[0])
    alone = [e.embed([t]).vectors[0] for t in TEXTS]
    batched = e.embed(TEXTS).vectors
    reordered = e.embed(TEXTS[::-1] + TEXTS).vectors
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = e.embed(TEXTS[2:] + TEXTS[:2]).vectors
    finally:
        torch.set_num_threads(threads)
    for i, v in enumerate(alone):
        assert torch.equal(batched[i], v)
        assert torch.equal(reordered[len(TEXTS) - 1 - i], v) and torch.equal(reordered[len(TEXTS) + i], v)
        assert torch.equal(one_thread[(i - 2) % len(TEXTS)], v)


@pytest.mark.parametrize("dtype, floor", [(torch.float32, 0.9999),
                                          pytest.param(torch.bfloat16, 0.999, marks=pytest.mark.slow)])
def test_token_states_match_transformers_on_the_same_weights(encoder, dtype, floor):
    """fp32 activations: every token's state within cosine 0.9999 of transformers' fp32 forward (bf16: 0.999)."""
    ours, hf = encoder
    h = ours.forward(TEXTS, dtype).float()
    start = 0
    for ids in TEXTS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).last_hidden_state[0]
        got = h[start:start + len(ids)]
        start += len(ids)
        assert F.cosine_similarity(got, ref, dim=-1).min() >= floor


def test_pooling_and_normalization_are_sentence_transformers_math(encoder):
    ours, hf = encoder
    with torch.no_grad():
        refs = [hf(torch.tensor([t])).last_hidden_state[0] for t in TEXTS]
    mean = embedder(ours, normalize=False).embed(TEXTS).vectors
    cls = embedder(ours, pooling="cls").embed(TEXTS).vectors
    last = embedder(ours, pooling="last").embed(TEXTS).vectors
    for i, ref in enumerate(refs):
        assert F.cosine_similarity(mean[i], ref.mean(0), dim=0) >= 0.9999
        assert torch.allclose(mean[i], ref.mean(0), atol=2e-5)
        assert torch.allclose(cls[i], F.normalize(ref[0], dim=0), atol=2e-5)
        assert torch.allclose(last[i], F.normalize(ref[-1], dim=0), atol=2e-5)
    assert torch.allclose(last.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-6)


def test_matryoshka_truncation_follows_the_model_card_and_other_models_refuse_it(encoder):
    ours, _ = encoder
    plain, nested = embedder(ours), embedder(ours, matryoshka=True)
    pooled = embedder(ours, normalize=False).embed(TEXTS).vectors
    cut = nested.embed(TEXTS, dimensions=16).vectors
    want = F.normalize(F.layer_norm(pooled, (64,))[:, :16], dim=-1)
    assert cut.shape == (len(TEXTS), 16) and torch.allclose(cut, want, atol=1e-5)
    assert torch.equal(plain.embed(TEXTS, dimensions=64).vectors, plain.embed(TEXTS).vectors)  # its own size
    with pytest.raises(OptionError, match="does not support `dimensions`") as exc:
        plain.embed(TEXTS, dimensions=16)
    assert exc.value.option == "dimensions"
    with pytest.raises(OptionError, match="1..64"):
        nested.embed(TEXTS, dimensions=65)


@pytest.mark.parametrize("inputs, match", [([], "not empty"), ([[]], "empty"), ([[1, VOCAB]], "not a token id"),
                                           ([[1, -1]], "not a token id"), ([list(range(101))], "at most 100")])
def test_what_cannot_be_embedded_is_refused_by_name(encoder, inputs, match):
    with pytest.raises(OptionError, match=match) as exc:
        embedder(encoder[0]).embed(inputs)
    assert exc.value.option == "input"


def test_the_kernels_follow_their_stated_math():
    torch.manual_seed(1)
    x = torch.randn(37, 96) * 3
    w, b = 1 + 0.1 * torch.randn(96), 0.1 * torch.randn(96)
    want = F.layer_norm(x, (96,), w.to(torch.bfloat16).float(), b, 1e-12)
    assert torch.allclose(ops.layer_norm(x, w.to(torch.bfloat16), b, 1e-12), want, atol=2e-5)
    g = torch.linspace(-12, 12, 4001)
    exact = g.double() * 0.5 * torch.special.erfc(-g.double() / 2 ** 0.5)  # torch's own GELU cancels to 0 here
    rel = (ops.gelu(g) - exact).abs() / exact.abs().clamp_min(1e-30)
    assert rel.max() < 3e-5 and rel[g.abs() <= 4].max() < 2e-6  # the far tail: fp32 rounding of -x*x/2 in exp
    q, k, v = (torch.randn(9, 4, 16) for _ in range(3))
    got = ops.bidirectional_attention(q, k, v, [4, 5], 0.25)
    for lo, hi in ((0, 4), (4, 9)):
        ref = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1),
                                             v[lo:hi].transpose(0, 1), scale=0.25).transpose(0, 1)
        assert torch.allclose(got[lo:hi], ref, atol=1e-5)


def test_a_pooled_sum_ignores_the_padding_of_longer_texts_bit_for_bit():
    """The batch pads every text to the longest: zeros inside and past a 32-block leave a sum's bits, -0 included."""
    torch.manual_seed(2)
    h = torch.randn(40, 8)
    h[:3, 0] = -0.0  # a column whose every value is -0: its sum is +0 alone and batched alike
    alone = ops.pooled_sum(h[:3], [3])
    batched = ops.pooled_sum(h, [3, 37])
    assert torch.equal(alone[0], batched[0])
    assert torch.allclose(batched[1], h[3:].sum(0), atol=1e-5)


def test_margingate_embed_reads_a_bert_folder_and_prints_json_lines(tmp_path, capsys):
    """An encoder's Hugging Face folder (transformers' safetensors + a tokenizer.json) through the command line:
    one JSON line per text, the library's vectors."""
    import json

    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    from margingate.cli import main
    from margingate.embeddings import is_embedding_model, load

    _, hf = random_encoder("bert", seed=4)
    hf.save_pretrained(tmp_path)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", "a"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(VOCAB - len(words))])}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                ("[SEP]", 3)])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert is_embedding_model(str(tmp_path))
    assert main(["embed", "--model", str(tmp_path), "Hello worlds", "a"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = load(str(tmp_path)).embed(["Hello worlds", "a"]).vectors
    assert [x["tokens"] for x in lines] == [5, 3]
    assert torch.equal(torch.tensor([x["embedding"] for x in lines]), want)


def test_a_decoder_pools_as_its_files_say_else_its_last_token(tmp_path):
    import json

    from margingate.embeddings import decoder_pooling

    assert decoder_pooling(tmp_path, None) == "last"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert decoder_pooling(tmp_path, None) == "mean"

