"""Where specd keeps what it downloads or derives: $SPECD_CACHE, default ~/.cache/specd."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("SPECD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd"
