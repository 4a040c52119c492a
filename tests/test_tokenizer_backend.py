"""The tokenizer on the `tokenizers` library alone gives transformers' ids and text (tokenizer_parity.py), and a
start imports no transformers once the folder's snapshot is taken. The real Qwen2.5-Coder-0.5B's check is in
test_real_qwen.py (slow)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tokenizer_parity import check_same_as_transformers

from margingate.models import tokenizer_snapshot
from margingate.models.tokenizer import Tokenizer


def test_embedded_model_tokenizes_as_transformers(model_dir):
    from transformers import AutoTokenizer

    assert check_same_as_transformers(Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))) > 100


def test_a_loaded_tokenizer_imports_no_transformers(model_dir):
    Tokenizer(model_dir)  # the snapshot exists
    code = ("import sys; from margingate.models.tokenizer import Tokenizer; t = Tokenizer(sys.argv[1]); "
            "print(t.encode('Hello world'), 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, check=True)
    ids, imported = out.stdout.split("]")
    assert ids.strip("[ ") and imported.strip() == "False", out.stdout


@pytest.mark.slow
def test_the_snapshot_is_transformers_build_not_the_file(tmp_path, model_dir, monkeypatch):
    """A folder whose tokenizer.json differs from what transformers builds (Qwen2's class adds NFC): the snapshot
    keeps transformers' build, and a changed file is a new snapshot."""
    monkeypatch.setenv("MARGINGATE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tok"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / f).write_bytes((model_dir / f).read_bytes())
    first = tokenizer_snapshot.key(folder)
    path, meta = tokenizer_snapshot.snapshot(folder)
    assert meta["eos_token_id"] is not None and "{%" in meta["chat_template"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    assert tokenizer_snapshot.key(folder) != first
    assert tokenizer_snapshot.snapshot(folder)[1]["eos_token_id"] != meta["eos_token_id"]


def test_threads_share_one_tokenizer(model_dir):
    """No private copy for the engine thread: decoding and encoding from several threads at once neither fails
    ("Already borrowed") nor mixes results."""
    from concurrent.futures import ThreadPoolExecutor

    tok = Tokenizer(model_dir)
    texts = [f"request {i}: the quick brown fox {i * 7919}" for i in range(64)]
    want = [tok.decode(tok.encode(t)) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: tok.decode(tok.encode(t)), texts * 4))
    assert got == want * 4
