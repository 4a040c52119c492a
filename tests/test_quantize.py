"""Quantize at load (issue 33): a bf16 folder's matrices as GGUF blocks, the same bytes in the GGUF that
`margingate export --quantize` writes, and the same tokens and logprobs from the folder and from that file.

The Q4_K quantizer (models/q4_k.py) writes blocks that gguf-py reads back to exactly our decoder's
values, within R/8 + 3e-5 of the bf16 weights (R: the range of the weight's 256-weight block, with 0;
3e-5: where fp16 d and dmin underflow, as llama.cpp's do), and byte for byte what llama.cpp's reference
quantizer writes (against its ggml library, where `make llamacpp-venv` installed it).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from margingate.models.gguf_quant import quant_codes
from margingate.models.q4_k import quantize_q4_k
from margingate.models.quantize import QuantizeError, block_type, quantize_rows

Q4_K = gguf.GGMLQuantizationType.Q4_K
ROOT = Path(__file__).resolve().parents[1]
# the embedded model quantized with q4_k: rows of 576 weights fall back to Q8_0, down_proj's 1536 are Q4_K
Q4_K_FORMATS = {"qkv": "q8_0", "o_proj": "q8_0", "gate_up": "q8_0", "down_proj": "q4_k", "lm_head": "q8_0",
                "embed": "q8_0"}


def bf16_values(a) -> np.ndarray:
    """float32 values a bf16 weight can hold."""
    return torch.from_numpy(np.asarray(a, np.float32)).bfloat16().float().numpy()


def weights(kind: str, rows: int = 16, k: int = 512) -> np.ndarray:
    rng = np.random.default_rng(len(kind))
    x = rng.standard_normal((rows, k))
    return bf16_values({
        "normal": x * 0.02, "uniform": rng.uniform(-1, 1, (rows, k)), "heavy-tailed": rng.standard_cauchy((rows, k)),
        "negative-only": -np.abs(x) - 0.5, "positive-only": np.abs(x) + 0.5, "offset": x * 0.01 + 1.0,
        "zero": np.zeros((rows, k)), "constant": np.full((rows, k), 0.37), "constant-negative": np.full((rows, k), -3.),
        "sparse": np.where(rng.random((rows, k)) < 0.05, x, 0.0), "tiny": x * 1e-6, "tinier": x * 1e-30,
        "huge": x * 1e5, "one-outlier": np.where(np.arange(k) % 256 == 7, 50.0, 1.0) * x,
        "mixed sub-blocks": x * np.repeat(10.0 ** rng.integers(-4, 2, (rows, k // 32)), 32, axis=1),
    }[kind])


KINDS = ("normal", "uniform", "heavy-tailed", "negative-only", "positive-only", "offset", "zero", "constant",
         "constant-negative", "sparse", "tiny", "tinier", "huge", "one-outlier", "mixed sub-blocks")


@pytest.mark.parametrize("kind", KINDS)
def test_q4_k_blocks_read_back_as_our_decoder_reads_them_within_the_bound(kind):
    x = weights(kind)
    blocks = quantize_q4_k(x)
    assert blocks.shape == (16, 512 // 256 * 144) and blocks.dtype == np.uint8
    theirs = gguf.quants.dequantize(blocks, Q4_K)
    ours = quant_codes(blocks, "Q4_K", kind).bf16()
    assert torch.equal(ours.view(torch.int16), torch.from_numpy(theirs.copy()).bfloat16().view(torch.int16))
    blocks_x, blocks_theirs = x.reshape(-1, 256), theirs.reshape(-1, 256)
    spread = blocks_x.clip(0).max(1, keepdims=True) - blocks_x.clip(None, 0).min(1, keepdims=True)
    assert (np.abs(blocks_theirs - blocks_x) <= spread / 8 + 3e-5).all()


def test_an_all_zero_block_is_all_zero_bytes_and_normal_weights_lose_under_8_percent():
    assert not quantize_q4_k(weights("zero")).any()
    x = weights("normal", 64, 1024)
    err = gguf.quants.dequantize(quantize_q4_k(x), Q4_K) - x
    assert 0.05 < np.sqrt((err ** 2).mean() / (x ** 2).mean()) < 0.08  # 4 bits: about 7 %, as llama.cpp's


def test_a_rows_blocks_do_not_depend_on_where_it_lies(monkeypatch):
    """Rows permuted (the export's Q/K order) or split across chunks and threads: the same blocks."""
    from margingate.models import q4_k

    x = weights("normal", 48, 1024)
    whole = quantize_q4_k(x)
    monkeypatch.setattr(q4_k, "CHUNK", 5)  # chunk edges inside rows, several chunks per thread
    perm = np.random.default_rng(0).permutation(48)
    assert np.array_equal(quantize_q4_k(x[perm]), whole[perm])


def _ggml_reference():
    """llama.cpp's quantize_row_q4_K_ref from the ggml library of the llama-cpp-python venv, or a skip."""
    python = Path(os.environ.get("MARGINGATE_LLAMACPP_PYTHON", ROOT / ".venv-llamacpp" / "bin" / "python"))
    libs = sorted(python.parent.parent.glob("lib/python*/site-packages/llama_cpp/lib/libggml-base.so"))
    if not libs:
        pytest.skip("llama.cpp's ggml library is not installed (make llamacpp-venv)")
    ref = ctypes.CDLL(str(libs[0])).quantize_row_q4_K_ref
    ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def quantize(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        out = np.zeros((x.size // 256, 144), np.uint8)
        ref(x.ctypes.data, out.ctypes.data, x.size)
        return out.reshape(x.shape[0], -1)
    return quantize


def test_q4_k_is_llama_cpps_reference_quantizer_byte_for_byte():
    reference = _ggml_reference()
    for kind in KINDS:
        x = weights(kind)
        assert np.array_equal(quantize_q4_k(x), reference(x)), kind


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_value_that_is_not_finite_is_refused_naming_the_tensor(type_name, value):
    w = torch.zeros(4, 256, dtype=torch.bfloat16)
    w[2, 9] = value
    name = "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(QuantizeError, match=rf"{name} .*not a finite number .*at row 2, column 9"):
        quantize_rows(w, type_name, name)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K"])
def test_weights_too_large_for_the_fp16_scales_are_refused(type_name):
    w = torch.full((2, 256), 1e9, dtype=torch.bfloat16)
    with pytest.raises(QuantizeError, match="lm_head.weight holds weights up to .* too large for .*fp16"):
        quantize_rows(w, type_name, "lm_head.weight")


def test_q8_0_blocks_are_gguf_pys_and_a_matrix_falls_back_by_its_rows():
    x = weights("normal", 4, 576)
    blocks = quantize_rows(torch.from_numpy(x).bfloat16(), "Q8_0", "w")
    assert np.array_equal(blocks, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0))
    assert [block_type(k, "q4_k") for k in (1536, 576, 100)] == ["Q4_K", "Q8_0", None]
    assert [block_type(k, "q8_0") for k in (1536, 576, 100)] == ["Q8_0", "Q8_0", None]


def test_the_state_holds_each_matrix_as_its_block_type_and_says_whether_to_keep_them(model_dir):
    """Only the matrices are quantized (lazily: nothing is quantized until the model is built); the norms
    stay as they are; contract=None (--weights bf16) asks the build for their dequantized values."""
    from margingate.models.loader import load_config, load_state_dict
    from margingate.models.quantize import QuantizedAtLoad, quantize_state
    from margingate.models.weights import matrix_names

    state = load_state_dict(model_dir)
    quantized = quantize_state(state, load_config(model_dir), "q4_k", contract=None)
    kinds = {n: t.type_name for n, t in quantized.items() if isinstance(t, QuantizedAtLoad)}
    assert set(kinds) == set(matrix_names(load_config(model_dir))) and len(kinds) == 1 + 30 * 7
    assert {n for n, k in kinds.items() if k == "Q4_K"} == {f"model.layers.{i}.mlp.down_proj.weight" for i in range(30)}
    assert quantized["model.norm.weight"] is state["model.norm.weight"]
    assert quantized.contract is None and quantized.source == state.source


# --- bad requests ---------------------------------------------------------------------------------


def test_quantize_refuses_a_gguf_source_and_an_unknown_type(model_dir):
    from margingate.errors import OptionError
    from margingate.llm import LLM

    with pytest.raises(QuantizeError, match="smollm2-135m is a GGUF model, quantized already"):
        LLM("smollm2-135m", quantize="q4_k")
    with pytest.raises(OptionError, match="quantize must be one of q8_0, q4_k .*got 'q5_k'"):
        LLM(str(model_dir), quantize="q5_k")


def test_every_command_that_loads_a_model_takes_quantize(capsys):
    from margingate.cli import build_parser, main

    commands = build_parser()._subparsers._group_actions[0].choices
    loading = [name for name, p in commands.items() if "--weights" in p._option_string_actions]
    assert len(loading) >= 10 and "generate" in loading
    assert all("--quantize" in commands[name]._option_string_actions for name in loading + ["export"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantize", "q5_k"])
    assert "invalid choice: 'q5_k'" in capsys.readouterr().err
    assert main(["export", "smollm2-135m", "--quantize", "q4_k"]) == 2
    assert "is a GGUF model, quantized already" in capsys.readouterr().err


# --- the promise, on the embedded model -------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(model_dir, tmp_path_factory):
    """The embedded model's bf16 folder exported with --quantize q4_k (through the command line)."""
    from margingate.cli import main

    out = tmp_path_factory.mktemp("export") / "smollm2.q4_k.gguf"
    assert main(["export", str(model_dir), "--quantize", "q4_k", "--out", str(out)]) == 0
    return out


@pytest.mark.slow  # the export quantizes all 135M weights
def test_the_exported_file_holds_the_blocks_the_folder_runs(exported, model_dir):
    """Every matrix is the folder's blocks (Q/K rows in llama.cpp's order); the norms F32."""
    from margingate.models.gguf_export import FILE_TYPES, permute
    from margingate.models.gguf_import import hf_name
    from margingate.models.loader import load_state_dict

    reader, state = gguf.GGUFReader(str(exported)), load_state_dict(model_dir)
    assert reader.fields["general.file_type"].contents() == FILE_TYPES["q4_k"]
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {n for n, k in kinds.items() if k == "Q4_K"} == {f"blk.{i}.ffn_down.weight" for i in range(30)}
    assert {k for n, k in kinds.items() if n.endswith("norm.weight")} == {"F32"}
    assert {k for n, k in kinds.items() if not n.endswith("norm.weight")} == {"Q4_K", "Q8_0"}
    for t in reader.tensors:
        if t.name.startswith(("blk.0.", "blk.17.", "token_embd")) and not t.name.endswith("norm.weight"):
            w = state[hf_name(t.name)]
            heads = {"attn_q": 9, "attn_k": 3}.get(t.name.split(".")[-2])
            w = permute(w, heads) if heads else w
            assert np.array_equal(np.array(t.data), quantize_rows(w, t.tensor_type.name, t.name)), t.name


@pytest.mark.slow  # five facades over the export
def test_a_folder_quantized_at_load_gives_its_exported_files_tokens_and_logprobs(exported, model_dir, llm, prompts):
    """LLM(folder, quantize="q4_k") and LLM(its exported GGUF), both under each quantized contract
    (--weights auto: int8; exact), and that GGUF at --weights bf16: under one contract the same tokens and
    logprobs, bitwise (greedy, `reference`), and exact equals bf16. Controls: the unquantized model's
    logprobs differ, and so do int8's from exact's, so the comparisons can fail."""
    from margingate.llm import LLM
    from margingate.models import loader
    from margingate.options import SamplingParams

    folders = {w: LLM(str(model_dir), quantize="q4_k", max_num_seqs=4, weights=w) for w in ("auto", "exact")}
    with pytest.MonkeyPatch.context() as mp:  # the GGUF's converted folder: in a temporary cache
        mp.setattr(loader, "cache_root", lambda: exported.parent / "cache")
        files = {w: LLM(str(exported), max_num_seqs=4, weights=w) for w in ("auto", "exact", "bf16")}
    for w in ("auto", "exact"):
        assert folders[w].environment()["weights"] == files[w].environment()["weights"] == Q4_K_FORMATS
        assert folders[w].environment()["quantized_contract"] == files[w].environment()["quantized_contract"]
    assert set(files["bf16"].environment()["weights"].values()) == {"bf16"}
    assert folders["auto"].environment()["quantize"] == "q4_k" and files["auto"].environment()["quantize"] is None
    chosen, params = [prompts[i] for i in (0, 12, 27)], SamplingParams(logprobs=2)

    def run(m):
        return [(c.token_ids, c.logprobs) for c in m.generate(chosen, max_new_tokens=12, policy=m.policy("reference"),
                                                              sampling=params)]
    exact, int8 = run(folders["exact"]), run(folders["auto"])
    assert run(files["exact"]) == exact and run(files["bf16"]) == exact
    assert run(files["auto"]) == int8
    assert [lp for _, lp in int8] != [lp for _, lp in exact]
    assert [lp for _, lp in run(llm)] != [lp for _, lp in exact]


def test_a_run_of_the_folder_is_never_reused_for_it_quantized_at_load(model_dir):
    """--quantize with --weights bf16 holds bf16 like the folder, with other values: the environment
    record names the quantization and the run cache's key differs (else a cached run of one would be
    reported as the other's)."""
    from margingate.analysis.runs import CachedRuns
    from margingate.llm import LLM

    plain, quantized = LLM(str(model_dir), max_num_seqs=1), LLM(str(model_dir), max_num_seqs=1, quantize="q8_0",
                                                                 weights="bf16")
    assert plain.environment()["weights"] == quantized.environment()["weights"]
    assert plain.environment()["quantize"] is None and quantized.environment()["quantize"] == "q8_0"
    keys = [CachedRuns(m, [[1, 2]], 4, progress=False).key({"policy": "reference"}) for m in (plain, quantized)]
    assert keys[0] != keys[1]
