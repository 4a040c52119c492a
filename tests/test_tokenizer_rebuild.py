"""The snapshot a GGUF's conversion takes from its own tokenizer (tokenizer_snapshot.same_on_reload: no second
build of the vocabulary) is the one the old way took from a load of the saved folder, for every class that skips
the load: the serialized tokenizer and meta.json byte for byte, and ids and texts against the reloaded transformers
tokenizer (built-in texts, special tokens, odd unicode). A synthetic Gemma 3 file runs in the default tier; the
real Gemma 3 270M, the 262k-token random file and Qwen2.5-Coder (whose class must not skip the load) in the slow one.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from tokenizer_parity import TEXTS, check_same_as_transformers

from margingate.models import gguf_import, tokenizer_snapshot
from margingate.models.tokenizer import Tokenizer

ODD = ["<bos><eos><pad><unk><mask>", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
       "two  spaces   three    four", "\u00a0nbsp\u200bzero-width\ufeffbom", "\u0301lone accent",
       "\U0001F600 \x00\x01\x7f",
       "<unused0> <unused1>x", "\n\n\n\nhello world"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _gemma_like_gguf(path: Path) -> Path:
    """A Gemma 3 file's tokenizer in small: its special, control and user-defined tokens, byte fallback, runs of
    spaces stored as spaces, pieces whose merges transformers derives from the token order, and a chat template."""
    words = ["he", "ll", "llo", "wo", "or", "af", "caf", "hello", "▁hello", "wor", "ld", "world", "▁world", "▁t",
             "th", "the", "▁the", "in", "ing", "▁in", "▁a", "é", "café", "▁café", "中文", "🤖"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>", "\n",
              "\n\n", "  ", "   ", *(f"<0x{b:02X}>" for b in range(256)), "▁", *"abcdefghijklmnopqrstuvwxyz.,!?'",
              *words, "<unused0>", "<unused1>"]
    kinds = {"[multimodal]": 4, "\n": 4, "\n\n": 4, "  ": 4, "   ": 4}
    types = [3 if t.startswith("<") and t.endswith(">") and not t.startswith("<0x") else 6 if t.startswith("<0x")
             else kinds.get(t, 1) for t in tokens]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_string("general.name", "tiny gemma-like tokenizer")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0 if k != 1 else -float(i) for i, k in enumerate(types)])
    w.add_token_types(types)
    for name, token in (("bos", "<bos>"), ("eos", "<eos>"), ("unk", "<unk>"), ("pad", "<pad>")):
        getattr(w, f"add_{name}_token_id")(tokens.index(token))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _converted(path: Path, tmp_path: Path, monkeypatch):
    """The folder the conversion writes for `path` (its snapshot taken, or not, as a first start takes it), and
    where that snapshot lies."""
    monkeypatch.setenv("MARGINGATE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "folder"
    folder.mkdir()
    gguf_import.save_tokenizer(path, folder, gguf_import.readers([path])[0])
    return folder, tmp_path / "cache" / "tokenizers" / tokenizer_snapshot.key(folder)


def check_taken_as_a_reload_takes_it(path: Path, tmp_path: Path, monkeypatch) -> None:
    """The snapshot taken at conversion equals the old way's (transformers' load of the saved folder; the
    serialization copied, padding and truncation off) file for file, and tokenizes as that load does."""
    from tokenizers import Tokenizer as Backend
    from transformers import AutoTokenizer

    folder, taken = _converted(path, tmp_path, monkeypatch)
    assert (taken / "meta.json").exists(), "the conversion took no snapshot: the class did not skip the reload"
    assert list(tokenizer_snapshot._HANDED) == [taken / "tokenizer.json"]
    handed = Tokenizer(folder)  # the conversion's own Rust tokenizer, handed over (tokenizer_snapshot.load)
    assert not tokenizer_snapshot._HANDED
    reloaded = AutoTokenizer.from_pretrained(str(folder))
    old = Backend.from_str(reloaded.backend_tokenizer.to_str())
    old.no_padding()
    old.no_truncation()
    old.save(str(tmp_path / "old.json"))
    assert (taken / "tokenizer.json").read_bytes() == (tmp_path / "old.json").read_bytes()
    tokenizer_snapshot.take(reloaded, tmp_path / "old")  # the meta, computed as it always was
    assert (taken / "meta.json").read_bytes() == (tmp_path / "old" / "meta.json").read_bytes()
    assert check_same_as_transformers(handed, reloaded) > 100
    read = Tokenizer(folder)  # a later start: the snapshot's file
    for text in [*TEXTS, *ODD]:
        ids = reloaded.encode(text, add_special_tokens=False)
        assert handed.encode(text) == read.encode(text) == ids, text
        assert handed.decode(ids, skip_special_tokens=False) == read.decode(ids, skip_special_tokens=False) \
            == reloaded.decode(ids, skip_special_tokens=False), text


def test_a_gemma_tokenizer_is_snapshot_at_conversion_as_a_reload_takes_it(tmp_path, monkeypatch):
    path = _gemma_like_gguf(tmp_path / "gemma-like.gguf")
    check_taken_as_a_reload_takes_it(path, tmp_path, monkeypatch)


def test_only_a_proven_class_skips_the_reload():
    from transformers import GemmaTokenizer, Qwen2Tokenizer, TokenizersBackend

    assert tokenizer_snapshot.same_on_reload(GemmaTokenizer())
    assert tokenizer_snapshot.same_on_reload(TokenizersBackend(vocab={"a": 0}, merges=[]))
    assert not tokenizer_snapshot.same_on_reload(Qwen2Tokenizer())
    subclass = type("Rebuilds", (GemmaTokenizer,), {"__init__": lambda self, **kw: GemmaTokenizer.__init__(self, **kw)})
    assert not tokenizer_snapshot.same_on_reload(subclass())  # a class of its own is not Gemma's, proven or not


REAL = {"gemma": Path("/tmp/mg-start/gemma-3-270m-q4_k_m.gguf"), "v262k": Path("/tmp/mg-start/v262k.q4_k.gguf")}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL))
def test_a_real_262k_file_is_snapshot_at_conversion_as_a_reload_takes_it(name, tmp_path, monkeypatch):
    if not REAL[name].exists():
        pytest.skip(f"{REAL[name]} is absent (results/load-time/README.md says how it is made)")
    check_taken_as_a_reload_takes_it(REAL[name], tmp_path, monkeypatch)


@pytest.mark.slow
def test_qwen2s_class_is_loaded_again_as_it_builds_another_tokenizer(tmp_path, monkeypatch):
    """Qwen2's class adds an NFC normalizer on a load: the conversion takes no snapshot, the first use loads it."""
    from transformers import AutoTokenizer

    path = Path.home() / ".cache" / "margingate" / "gguf" / "qwen2.5-coder-0.5b.gguf"
    if not path.exists():
        pytest.skip(f"{path} is absent (make models)")
    folder, taken = _converted(path, tmp_path, monkeypatch)
    assert not taken.exists()
    reloaded = AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer
    assert reloaded.normalizer is not None and reloaded.to_str(pretty=True) != (folder / "tokenizer.json").read_text()
