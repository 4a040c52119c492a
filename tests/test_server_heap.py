"""The server gives the C heap's free pages back once idle (issue 47's soak: VmRSS stepped up under traffic
and stayed there, free memory kept in glibc's arenas; `margingate/server/core/heap.py`).

`malloc_trim` is checked on a heap of our own making (free memory the allocator keeps, which only a trim
returns), the idle rule on a clock we move, and the engine thread on a real server: one trim per idle
spell after traffic, none while nothing ran.
"""
from __future__ import annotations

import ctypes
import time

import pytest

from margingate.server.core import heap

needs_glibc = pytest.mark.skipif(not heap.available() or heap.resident_bytes() is None,
                                 reason="malloc_trim is glibc's, /proc/self/statm Linux's")
BLOCK, BLOCKS, KEEP_EVERY = 32 << 10, 2048, 64  # 64 MiB in blocks far below any mmap threshold


@needs_glibc
def test_trim_returns_free_heap_pages_that_free_kept():
    """Blocks freed between blocks still held leave 2 MiB holes inside the heap: free() keeps them
    resident (only a heap's top is ever returned on free), malloc_trim hands their pages back."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)  # resident
    kept = blocks[::KEEP_EVERY]
    try:
        for i, b in enumerate(blocks):
            if i % KEEP_EVERY:
                libc.free(b)
        freed = (BLOCKS - len(kept)) * BLOCK
        released = heap.trim()
        assert released is not None and released >= freed // 2, (released, freed)
    finally:
        for b in kept:
            libc.free(b)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@needs_glibc
def test_idle_trim_once_per_idle_spell_and_only_after_work():
    clock = Clock()
    t = heap.IdleTrim(1.0, clock)
    assert t.idle() is None  # idle since start, nothing ran: nothing to give back
    clock.now = 5.0
    assert t.idle() is None and t.trims == 0
    t.busy()
    clock.now = 6.0
    assert t.idle() is None  # the spell starts now
    clock.now = 6.5
    assert t.idle() is None  # half a second: traffic may come back
    clock.now = 7.0
    assert t.idle() is not None and t.trims == 1
    clock.now = 60.0
    assert t.idle() is None and t.trims == 1  # one trim per spell
    t.busy()
    clock.now = 61.0
    t.idle()
    clock.now = 62.0
    assert t.idle() is not None and t.trims == 2
    assert not heap.IdleTrim(0, clock).enabled and not heap.IdleTrim(None, clock).enabled


@needs_glibc
def test_server_trims_once_idle_after_traffic(llm):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from server_fixtures import TIMEOUT, is_idle, make_server, poll

    srv = make_server(llm, slots=4, heap_trim_idle_s=0.3)
    metrics = srv.state.metrics
    try:
        time.sleep(0.6)
        assert metrics.value("heap_trims_total") == 0  # idle from the start, nothing ran
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as http:
            for n in (1, 2):
                r = http.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 4})
                assert r.status_code == 200
                assert poll(lambda n=n: metrics.value("heap_trims_total") == n, timeout=30)
                time.sleep(0.6)
                assert metrics.value("heap_trims_total") == n  # once per idle spell
            text = http.get("/metrics").text
        assert "margingate_heap_trims_total 2" in text and "margingate_heap_released_bytes_total" in text
        assert poll(lambda: is_idle(srv))
    finally:
        srv.stop()


def test_heap_trim_idle_must_not_be_negative():
    from margingate.server.core.config import ServerConfig

    with pytest.raises(ValueError, match="heap_trim_idle_s"):
        ServerConfig(heap_trim_idle_s=-1)
