"""models/CHECKSUMS.sha256: integrity of the committed demo pair.

Covers every file in both model directories except the cards (README.md), which are
prose and may be edited by hand; the numbers they quote live in eval.json, which is covered.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FILENAME = "CHECKSUMS.sha256"
UNCHECKED = {"README.md"}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def covered_files(root: Path, model_dirs: list[str]) -> list[str]:
    """Paths relative to root, sorted, in `sha256sum` style."""
    rels = []
    for name in model_dirs:
        for p in sorted((root / name).rglob("*")):
            if p.is_file() and p.name not in UNCHECKED:
                rels.append(p.relative_to(root).as_posix())
    return rels


def write_checksums(root: Path, model_dirs: list[str]) -> Path:
    lines = [f"{_sha256(root / rel)}  {rel}\n" for rel in covered_files(root, model_dirs)]
    out = root / FILENAME
    out.write_text("".join(lines), encoding="utf-8")
    return out


def verify_checksums(root: Path) -> int:
    """Check every listed file; raise naming the first bad one. Returns files checked."""
    listing = root / FILENAME
    if not listing.is_file():
        raise FileNotFoundError(f"{listing} not found; run `specd demo-models --retrain`")
    count = 0
    for line in listing.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        digest, _, rel = line.partition("  ")
        path = root / rel
        if not path.is_file():
            raise FileNotFoundError(f"checksum failed: {path} is missing")
        if _sha256(path) != digest:
            raise ValueError(f"checksum failed: {path} does not match {FILENAME}")
        count += 1
    if count == 0:
        raise ValueError(f"{listing} lists no files")
    return count
