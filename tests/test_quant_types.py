"""Q2_K, Q3_K, IQ4_NL, IQ4_XS and the IQ1/IQ2/IQ3 grids kept quantized under the integer-exact contract
(issue 64), in a whole model.

Two tiny Llamas written as GGUFs whose matrices are these types (valid blocks, scales sized so the weights
are about N(0, 0.02)): under `weights="auto"` every matrix stays quantized in its own type, and
each int8 path this CPU runs gives the same tokens and logprobs (the paths' proofs and the kernel tests
are tests/test_int8_linear.py's); under `"exact"`, which has no layout for these types, they are
dequantized at load and the model is the bf16 one, bit for bit. llama.cpp's own quantizations of a
random 1B are results/quantized/types/'s.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from margingate.kernels import invariant as K
from margingate.models import loader
from margingate.models.gguf_quant import TYPES

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_gguf_import import _embedded_reader  # noqa: E402
from test_quantized import FP16_FIELDS, random_tensor, set_fp16  # noqa: E402

gguf = pytest.importorskip("gguf")

HIDDEN, INTER, HEADS, KV, LAYERS = 256, 512, 4, 2, 2
# which type each matrix takes: every new type in the attention and the MLP, a fused q|k|v of two types
TYPE_OF = {"attn_q": "Q3_K", "attn_k": "Q3_K", "attn_v": "IQ4_XS", "attn_output": "Q2_K", "ffn_gate": "IQ4_NL",
           "ffn_up": "IQ4_NL", "ffn_down": "Q3_K", "token_embd": "IQ4_XS", "output": "Q2_K"}
IQ_TYPE_OF = {"attn_q": "IQ3_XXS", "attn_k": "IQ3_XXS", "attn_v": "IQ3_S", "attn_output": "IQ2_XXS",
              "ffn_gate": "IQ2_XS", "ffn_up": "IQ2_S", "ffn_down": "IQ1_M", "token_embd": "IQ1_S", "output": "IQ3_S"}
# each model's matrix groups as the environment names their storage
MODELS = {"k-and-iq4": (TYPE_OF, {"qkv": "q3_k+iq4_xs", "o_proj": "q2_k", "gate_up": "iq4_nl", "down_proj": "q3_k",
                                  "lm_head": "q2_k", "embed": "iq4_xs"}),
          "iq-grids": (IQ_TYPE_OF, {"qkv": "iq3_xxs+iq3_s", "o_proj": "iq2_xxs", "gate_up": "iq2_xs+iq2_s",
                                    "down_proj": "iq1_m", "lm_head": "iq3_s", "embed": "iq1_s"})}


def _weights(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row bytes] of valid blocks whose values have a standard deviation of about 0.02: random codes,
    the fp16 scales (d, and dmin where the type has one) one positive value, scaled to that."""
    data = random_tensor(type_name, n, k, seed).copy()
    nbytes = TYPES[type_name][1]
    a, b = FP16_FIELDS[type_name]
    blocks = data.reshape(-1, nbytes)
    set_fp16(blocks, type_name, np.full((blocks.shape[0], (b - a) // 2), 1.0))
    std = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).std()
    set_fp16(blocks, type_name, np.full((blocks.shape[0], (b - a) // 2), 0.02 / std))
    return data


def _write(path, type_of: dict) -> None:
    vocab = 49152
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", INTER), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in _embedded_reader().fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    head = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV * head, HIDDEN), "attn_v": (KV * head, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}
    tensors = {"token_embd.weight": ("token_embd", (vocab, HIDDEN)), "output.weight": ("output", (vocab, HIDDEN))}
    for i in range(LAYERS):
        tensors.update({f"blk.{i}.{m}.weight": (m, s) for m, s in shapes.items()})
    for seed, (name, (kind, (n, k))) in enumerate(sorted(tensors.items())):
        qt = gguf.GGMLQuantizationType[type_of[kind]]
        w.add_tensor(name, _weights(type_of[kind], n, k, seed), raw_dtype=qt)
    norms = ["output_norm.weight"] + [f"blk.{i}.{m}.weight" for i in range(LAYERS) for m in ("attn_norm", "ffn_norm")]
    for name in norms:
        w.add_tensor(name, np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_file(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("quant-types")
    patch = pytest.MonkeyPatch()
    patch.setattr(loader, "cache_root", lambda: root / "cache")
    _write(root / "tiny-types.gguf", MODELS[request.param][0])
    yield root / "tiny-types.gguf", MODELS[request.param][1]
    patch.undo()


@pytest.mark.slow  # a model of 49152 x 256 embeddings, loaded and run on each path: about 30 s on 2 cores
def test_each_new_type_stays_quantized_and_every_int8_path_gives_one_digest(model_file):
    from margingate.llm import LLM
    from margingate.options import SamplingParams

    path, storage = model_file
    llm = LLM(str(path), weights="auto", max_num_seqs=2)
    assert llm.environment()["quantized_contract"] == "int8"
    assert llm.environment()["weights"] == storage
    prompts, params = ["The quick brown fox", "One, two, three,"], SamplingParams(logprobs=2)
    paths = K.usable_paths("int8")
    assert paths, "no int8 path passed its proof"
    before, got = K.path_in_use("int8"), {}
    try:
        for path in paths:
            K.use_path(path)
            out = llm.generate(prompts, max_new_tokens=8, policy=llm.policy("reference"), sampling=params)
            got[path] = ([c.token_ids for c in out], [c.logprobs for c in out])
    finally:
        K.use_path(before)
    assert all(v == got[paths[0]] for v in got.values()), list(got)
    assert len(set(map(tuple, got[paths[0]][0]))) == 2  # two prompts, two continuations


@pytest.mark.slow  # two more models
def test_under_the_exact_contract_the_new_types_are_the_bf16_model(model_file):
    from margingate.llm import LLM

    path, storage = model_file
    exact, bf16 = LLM(str(path), weights="exact", max_num_seqs=1), LLM(str(path), weights="bf16", max_num_seqs=1)
    kept = set(exact.environment()["weights"].values()) - {"bf16"}  # IQ3_S: held as plain 5-bit codes
    assert kept <= {"iq3_s"} and (kept == {"iq3_s"}) == ("iq3_s" in set(storage.values()))
    got = exact.generate(["Hello"], max_new_tokens=8, policy=exact.policy("reference"))
    want = bf16.generate(["Hello"], max_new_tokens=8, policy=bf16.policy("reference"))
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
