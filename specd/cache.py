"""Where specd keeps what it downloads or derives: $SPECD_CACHE, default ~/.cache/specd."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("SPECD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
