"""Model profiles: the calibrated `tau` (and how it was obtained) for one model.

A profile is matched by the model's fingerprint (its shape and name), looked up
first in the user's cache (`margingate calibrate` writes there), then among the
profiles shipped with the package. The engine's default `tau` comes from it.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .models.config import ModelConfig
from .paths import cache_root


def user_dir() -> Path:
    return cache_root() / "profiles"


def _filename(config: ModelConfig) -> str:
    return f"{config.name}-{config.fingerprint()}.json"


def load_profile(config: ModelConfig) -> dict | None:
    name = _filename(config)
    user = user_dir() / name
    if user.exists():
        return json.loads(user.read_text())
    shipped = resources.files("margingate.data") / "profiles" / name
    if shipped.is_file():
        return json.loads(shipped.read_text())
    return None


def save_profile(config: ModelConfig, profile: dict, folder: Path | None = None) -> Path:
    folder = folder or user_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _filename(config)
    path.write_text(json.dumps({"model": config.name, "fingerprint": config.fingerprint(), **profile}, indent=2))
    return path
