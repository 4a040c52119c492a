"""Where a GGUF model's packed matrices live while it runs: `MARGINGATE_WEIGHTS_MEMORY`.

- `mapped` (the default): views of the packed cache file's map (packed_cache.py). Every process that loads the
  file shares one copy (the page cache's), a page is resident once touched, and a start maps rather than reads.
  The cache writes the file in whole 2 MiB pieces (packed_cache.WholePieces), so where the kernel and the
  filesystem keep it in 2 MiB folios (ext4, xfs on recent kernels) the map takes one TLB entry per 2 MiB.
- `huge`: read at load into this process's own memory, in 2 MiB pages where the kernel gives them (transparent
  huge pages, asked for with MADV_HUGEPAGE), for kernels or filesystems whose page cache keeps 4 KiB pages: a
  B = 1 decode step streams every matrix once, and over 4 KiB pages that stream takes a page-table walk every
  4 KiB while the hardware prefetchers stop at each page's end. What it costs: the read at every start (1.2-1.6
  s for 650 MB on a Zen 4, most of it the kernel compacting memory into 2 MiB pages), and each process holds its
  own copy. On that Zen 4 (2 threads, the 1B Q4_K_M, processes alternating) the three steps came out within the
  host's noise of each other (results/roofline/README.md), so `mapped` is the default.

The bytes, and so every bit computed from them, are the file's either way. The token embedding stays mapped in
both: a step reads a few of its rows, not the whole matrix.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from ..errors import notice

MODES = ("mapped", "huge")
VARIABLE = "MARGINGATE_WEIGHTS_MEMORY"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
GATHERED = ("embed",)  # read by rows, never streamed whole


def mode() -> str:
    """The mode the environment asks for; a ValueError naming the variable for anything else."""
    value = os.environ.get(VARIABLE, "mapped")
    if value not in MODES:
        raise ValueError(f"{VARIABLE}={value!r}: it must be one of {', '.join(MODES)}")
    return value


def private_matrices(names) -> list[str]:
    """The packed matrices (by our names) to read into this process's memory under the mode asked for."""
    if mode() != "huge":
        return []
    if huge_pages_offered() is False:
        _say_no_huge_pages()
    return [n for n in names if n not in GATHERED]


@functools.cache
def _say_no_huge_pages() -> None:
    notice(f"{VARIABLE}=huge, but this kernel offers no transparent huge pages ({THP_SETTING}: never): the "
           "matrices are read into 4 KiB pages of this process's own, which gains nothing over `mapped`")


def huge_pages_offered() -> bool | None:
    """Whether the kernel gives transparent huge pages to a region that asks (None where it does not say)."""
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return None
