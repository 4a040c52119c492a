"""Where a GGUF model's packed matrices live while it runs: `MARGINGATE_WEIGHTS_MEMORY`.

- `mapped` (the default): views of the packed cache file's map (packed_cache.py). Every process that loads the
  file shares one copy (the page cache's), a page is resident once touched, and a start maps rather than reads.
- `huge`: read at load into this process's own memory, in 2 MiB pages where the kernel gives them (transparent
  huge pages, asked for with MADV_HUGEPAGE). A B = 1 decode step streams every matrix once; over 4 KiB pages of
  a file map that stream takes a page-table walk every 4 KiB and the hardware prefetchers stop at each page's
  end. On a Zen 4 (2 threads, the 1B Q4_K_M) its median step was 6 % shorter than mapped, processes alternating
  (results/roofline/README.md). What it costs: the read at every start (1.2-1.6 s for 650 MB there, most of it
  the kernel compacting memory into 2 MiB pages; far less where free huge pages wait), and each process holds its
  own copy. Hence `mapped` by default; a long-running server may choose `huge`.

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
