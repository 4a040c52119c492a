"""What the process keeps resident: the C heap's free pages go back when `LLM.generate` returns (libc.trim), and
the engine keeps one tokenizer. Each saving would come back silently if its call went away."""
from __future__ import annotations

import ctypes

import pytest

from margingate import libc

needs_linux_glibc = pytest.mark.skipif(not libc.can_trim() or libc.resident_bytes() is None,
                                       reason="malloc_trim is glibc's, /proc/self/statm Linux's")


@needs_linux_glibc
def test_generate_hands_the_heap_free_pages_back(llm):
    """16 MiB freed in holes between blocks still held (glibc keeps them resident: only a heap's top goes back
    on free) are gone once `generate` returns: a trim right after it has nothing left to give."""
    c = ctypes.CDLL(None)
    c.malloc.restype, c.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    c.free.argtypes = [ctypes.c_void_p]
    block, count = 32 << 10, 512
    blocks = [c.malloc(block) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, block)
    kept = blocks[::64]
    try:
        for i, b in enumerate(blocks):
            if i % 64:
                c.free(b)
        llm.generate("Hello", max_new_tokens=1)
        assert libc.trim() < (4 << 20)  # without generate's trim: about 16 MiB
    finally:
        for b in kept:
            c.free(b)


def test_the_engine_keeps_one_tokenizer(llm):
    """The detokenizer and the grammars read the facade's tokenizer, with no private copy (a second Rust
    tokenizer of a 49,152-token vocabulary is about 13 MB resident); llguidance's own table of it is built on a
    grammar's first use, never at load."""
    assert llm.engine.detokenize.args[0] is llm.tokenizer
    assert llm.grammars.text_tokenizer is llm.tokenizer
    from margingate.engine.structured import Grammars

    assert Grammars(llm.tokenizer, llm.config.vocab_size)._tokenizer is None
