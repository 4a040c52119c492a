"""The merges derived from a GGUF vocabulary without merges (models/gguf_merges.py) are transformers'
generate_merges', element for element: on a Gemma-like vocabulary (positions as scores, runs of spaces spelled as
transformers respells them, tokens of one character, unicode past the BMP), and on every call the shortcut hands
back to transformers (tied scores, a NaN, tokens to skip, no scores). Slow: the real Gemma 3 270M's 262k tokens."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from margingate.models import gguf_import, gguf_merges


def _theirs():
    from transformers.tokenization_utils_base import generate_merges

    return generate_merges


def _positions(tokens: list[str]) -> tuple[dict, dict]:
    """vocab and scores as transformers' gemma_tokenizer hands them to generate_merges."""
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    return {t: i for i, t in enumerate(respelled)}, {t: -i for i, t in enumerate(respelled)}


def _random_vocab(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcde\u2581é中🤖 "
    tokens = list(alphabet) + ["  ", "   ", "\u2581\u2581"]
    while len(tokens) < 3000:
        tokens.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))))
    return tokens  # duplicates kept: a vocabulary's later spelling of a token wins its id, as in transformers


def test_derived_merges_are_transformers():
    vocab, scores = _positions(_random_vocab(0))
    ours = gguf_merges.generate_merges(vocab, scores, theirs=None)  # the shortcut: transformers is not asked
    assert len(ours) > 1000 and ours == _theirs()(vocab, scores)


@pytest.mark.parametrize("case", ["tied", "nan", "skip", "no scores"])
def test_what_the_shortcut_does_not_cover_is_transformers_own(case):
    vocab, scores = _positions(_random_vocab(1))
    args = {"tied": (dict.fromkeys(scores, 0.0), None), "nan": ({**scores, "a": float("nan")}, None),
            "skip": (scores, ["ab"]), "no scores": (None, None)}[case]
    calls = []
    got = gguf_merges.generate_merges(vocab, *args, theirs=lambda *a: calls.append(a) or _theirs()(*a))
    assert calls and got == _theirs()(vocab, *args)


@pytest.mark.slow
def test_the_real_gemma_vocabulary_derives_transformers_merges():
    path = Path("/tmp/mg-start/gemma-3-270m-q4_k_m.gguf")
    if not path.exists():
        pytest.skip(f"{path} is absent (results/load-time/README.md says how it is made)")
    vocab, scores = _positions(gguf_import.readers([path])[0].meta["tokenizer.ggml.tokens"])
    ours = gguf_merges.generate_merges(vocab, scores, theirs=None)
    assert len(ours) == 514906 and ours == _theirs()(vocab, scores)
