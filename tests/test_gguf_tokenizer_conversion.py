"""A GGUF's tokenizer converted without AutoTokenizer's whole-file read (gguf_import.gguf_tokenizer) is
AutoTokenizer's, file for file, and the snapshot taken as the folder is written (tokenizer_snapshot.take_for) is
the one a later load of the folder through transformers takes. Slow tier: AutoTokenizer's own conversion of
the embedded file reads it with gguf's reader (tens of seconds on 2 cores)."""
from __future__ import annotations

import pytest

from margingate.models import gguf_import, loader, tokenizer_snapshot

pytestmark = pytest.mark.slow


def test_the_embedded_gguf_converts_and_snapshots_as_transformers(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    path = loader.embedded_gguf_path("smollm2-135m")
    monkeypatch.setenv("MARGINGATE_CACHE", str(tmp_path / "cache"))
    header = gguf_import.readers([path])[0]
    ours, auto = tmp_path / "ours", tmp_path / "auto"
    ours.mkdir()
    gguf_import.save_tokenizer(path, ours, header)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.chat_template = tok.chat_template or header.meta.get("tokenizer.chat_template")
    tok.save_pretrained(str(auto))
    names = sorted(f.name for f in auto.iterdir())
    assert names == sorted(f.name for f in ours.iterdir()) and "tokenizer.json" in names
    for name in names:
        assert (ours / name).read_bytes() == (auto / name).read_bytes(), name
    taken = tmp_path / "cache" / "tokenizers" / tokenizer_snapshot.key(ours)
    assert (taken / "meta.json").exists()  # TokenizersBackend: taken as the folder was written
    tokenizer_snapshot.take(AutoTokenizer.from_pretrained(str(ours)), tmp_path / "reloaded")
    for name in ("tokenizer.json", "meta.json"):
        assert (taken / name).read_bytes() == (tmp_path / "reloaded" / name).read_bytes(), name
