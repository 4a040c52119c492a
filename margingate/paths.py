"""Where margingate keeps what it converts, measures and downloads (models, profiles, runs, auto's rules):
one folder, `MARGINGATE_CACHE` or ~/.cache/margingate."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MARGINGATE_CACHE", Path.home() / ".cache" / "margingate"))
