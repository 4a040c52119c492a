"""The C library's memory calls margingate makes (glibc on Linux: malloc_trim, mallopt, madvise), each looked
up once. Where the library lacks one (musl, macOS) the lookup gives None and the caller does nothing."""
from __future__ import annotations

import ctypes
import functools


@functools.cache
def function(name: str, argtypes: tuple, restype):
    """The C library's `name` with its argument and result types set, or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
