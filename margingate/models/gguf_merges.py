"""The merges of a GGUF vocabulary that lists none (Gemma's), as transformers derives them, without its sorts.

transformers' GGUF conversion recovers a SentencePiece-style file's merges from its vocabulary with
`tokenization_utils_base.generate_merges`: every split of every token whose halves are tokens, sorted within the
token by the halves' ids, then the whole list sorted (stably, descending) by the token's score and the halves'
lengths. For Gemma 3's 262,144 tokens that is 515k merges and about 2 s of a first start, a third of it sorting.
Gemma's scores are its tokens' positions, all different: then the final order is fixed by the key alone (two
merges with one key would be two splits of one token at one place), tokens by score descending and each token's
splits by the left half's length descending, and both sorts can go. `generate_merges` below builds that order
directly where the scores are all different and hands any other call to transformers' own.
tests/test_gguf_merges.py holds the two equal.
"""
from __future__ import annotations

import contextlib


def generate_merges(vocab: dict[str, int], vocab_scores: dict[str, float] | None = None, skip_tokens=None,
                    *, theirs=None) -> list[tuple[str, str]]:
    """transformers' generate_merges, the same list; `theirs`: transformers' function, for what the shortcut
    does not cover (no scores, tokens to skip, two tokens with one score or a NaN)."""
    scores = dict(vocab_scores) if vocab_scores is not None else None
    values = set(scores.values()) if scores is not None else set()
    if scores is None or skip_tokens is not None or len(values) != len(scores) or any(v != v for v in values):
        return theirs(vocab, vocab_scores, skip_tokens)
    return [(token[:i], token[i:]) for token in sorted(scores, key=scores.__getitem__, reverse=True)
            for i in range(len(token) - 1, 0, -1) if token[:i] in vocab and token[i:] in vocab]


@contextlib.contextmanager
def derived_fast():
    """While transformers converts a GGUF's tokenizer, its merges come from `generate_merges` above."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    real = mapping.generate_merges

    def fast(vocab, vocab_scores=None, skip_tokens=None):
        return generate_merges(vocab, vocab_scores, skip_tokens, theirs=real)

    mapping.generate_merges = fast
    try:
        yield
    finally:
        mapping.generate_merges = real
