"""What transformers' tokenizer classes read from a GGUF while we convert it (gguf_import.metadata_already_read):
our header walk's metadata in the form of transformers' own reader, equal to that reader's output key for key,
so a first start walks a 262k-token vocabulary once, not twice. The whole conversion against AutoTokenizer's,
file for file, is tests/test_gguf_tokenizer_conversion.py (slow tier)."""
from __future__ import annotations

import pytest

from margingate.models import gguf_import, loader

ASKED = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")  # what get_gguf_tokenizer asks for in full


@pytest.fixture(scope="module")
def embedded():
    path = loader.embedded_gguf_path("smollm2-135m")
    return path, gguf_import.readers([path])[0]


def test_our_walk_in_transformers_form_is_transformers_reading(embedded):
    from transformers.integrations.gguf.reader import read_gguf_metadata

    path, header = embedded
    theirs, names = read_gguf_metadata(str(path), ASKED)
    assert gguf_import.transformers_view(header.meta, ASKED) == theirs
    assert tuple(t.name for t in header.tensors) == names
    # the control: our walk as it is holds every string array in full, theirs only the asked ones
    assert header.meta != theirs


def test_the_reader_answers_from_our_walk_for_this_file_only(embedded, tmp_path):
    from transformers.integrations.gguf import reader

    path, header = embedded
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    real = reader.read_gguf_metadata
    with gguf_import.metadata_already_read(path, header):
        meta, _ = reader.read_gguf_metadata(str(path), ASKED)
        assert meta["tokenizer.ggml.tokens"] is header.meta["tokenizer.ggml.tokens"]  # no second walk
        with pytest.raises(Exception):  # another file goes to transformers' reader (too short to be a GGUF)
            reader.read_gguf_metadata(str(other))
    assert reader.read_gguf_metadata is real
