"""Handing the C heap's free pages back to the system once the server goes idle (issue 47's soak).

Under concurrent traffic the engine's biggest steps (many prompts prefilled in one forward) allocate tensors
of several MiB. glibc serves them from its heaps rather than from fresh mappings: freeing the model's
load-time buffers raised its mmap threshold to 32 MiB. Freed, that memory stays in the heaps for reuse, so
the resident size steps up to the largest step's working set during the first minute of traffic and then
stays flat (results/soak/README.md: a plateau, not a slope). `malloc_trim(0)` returns the free pages of
every arena, a few milliseconds for this server's heaps; the engine thread calls it once per idle spell
(`IdleTrim`), so traffic never waits on it. Without glibc (musl, macOS) this does nothing.

Trimming returns only the free pages at the heaps' tops: after 20 minutes of 16 clients, 16 arenas still
kept about 40 MiB free but fragmented (`scripts/heap_probe.py`: `fordblks`). So `IdleTrim` also fixes the
mmap threshold at 8 MiB (`mallopt`): a step's transient tensors above it are mapped and unmapped, never
left in an arena (results/soak/heap-probe: +1.1 % over a soak at 8 MiB, against +5.5 % with the dynamic one).
"""
from __future__ import annotations

import ctypes
import time

from ... import libc
from ...libc import resident_bytes, trim

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """glibc: allocations of `nbytes` and more are mapped on their own and unmapped when freed (this also
    turns off the dynamic threshold). False without glibc."""
    fn = libc.function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return fn is not None and fn(M_MMAP_THRESHOLD, nbytes) == 1


available = libc.can_trim  # malloc_trim is glibc's


class IdleTrim:
    """Calls `trim` once the engine has been idle `after_s` seconds, once per idle spell (only if it worked
    since the last trim). `after_s` 0 or None: never."""

    def __init__(self, after_s: float | None, clock=time.monotonic, also=None):
        """`also`: called at each trim too (the KV pool's free pages go back); the resident bytes both gave back
        are counted."""
        self.after_s, self.clock, self.also = after_s, clock, also
        if self.enabled:
            fix_mmap_threshold()
        self.trims, self.released = 0, 0   # how many trims ran, the resident bytes they gave back
        self._idle_since: float | None = None
        self._worked = False

    @property
    def enabled(self) -> bool:
        return bool(self.after_s) and available()

    def busy(self) -> None:
        self._idle_since, self._worked = None, True

    def idle(self) -> int | None:
        """The engine has nothing to do now: trims if the spell has lasted long enough; the bytes released,
        or None when it did not trim."""
        if not self._worked or not self.enabled:
            return None
        now = self.clock()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.after_s:
            return None
        self._worked = False
        before = resident_bytes()
        trimmed = trim()
        if self.also is not None:
            self.also()
        after = resident_bytes()
        released = max(0, before - after) if before is not None and after is not None else trimmed or 0
        self.trims += 1
        self.released += released
        return released
