"""The C library's memory calls margingate makes (glibc on Linux: malloc_trim, mallopt, madvise), each looked
up once. Where the library lacks one (musl, macOS) the lookup gives None and the caller does nothing."""
from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def function(name: str, argtypes: tuple, restype):
    """The C library's `name` with its argument and result types set, or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    return function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def can_trim() -> bool:
    return _malloc_trim() is not None


def resident_bytes() -> int | None:
    """This process's resident set (Linux: /proc/self/statm), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim() -> int | None:
    """Give every malloc arena's free pages back to the system: glibc keeps what `free` returns inside its heaps
    (only a heap's top ever goes back on its own). The resident bytes that went (0 if none could), or None
    without glibc."""
    fn = _malloc_trim()
    if fn is None:
        return None
    before = resident_bytes()
    fn(0)
    after = resident_bytes()
    return max(0, before - after) if before is not None and after is not None else 0
