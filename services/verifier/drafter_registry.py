"""Drafters registered at runtime, kept in a JSON file (--drafter-registry) so that a restarted
verifier registers them again: what an operator added with `specd drafters add` survives a
crash or a redeploy. Command-line drafters are not kept (the command line says them again)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("specd.verifier.pool")


class DrafterRegistry:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> list[dict]:
        """[{"name", "address", "trusted"}]; a missing file is empty, a bad one an error naming it."""
        if not self.path.exists():
            return []
        try:
            entries = json.loads(self.path.read_text())
            ok = isinstance(entries, list) and all(
                isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("address"), str)
                and isinstance(e.get("trusted", False), bool) for e in entries)
        except (OSError, ValueError) as e:
            raise ValueError(f"--drafter-registry: cannot read {self.path}: {e}") from None
        if not ok:
            raise ValueError(f"--drafter-registry: {self.path} is not a list of {{name, address, trusted}}")
        return [{"name": e["name"], "address": e["address"], "trusted": e.get("trusted", False)} for e in entries]

    def add(self, name: str, address: str, trusted: bool) -> None:
        self._save([e for e in self.load() if e["name"] != name] + [{"name": name, "address": address,
                                                                    "trusted": trusted}])

    def remove(self, name: str) -> None:
        entries = self.load()
        if any(e["name"] == name for e in entries):
            self._save([e for e in entries if e["name"] != name])

    def _save(self, entries: list[dict]) -> None:
        """Written whole to a temporary file and renamed over the old one: a crash mid-write
        leaves the previous file, never half of one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        log.info("drafter registry %s: %s", self.path, ", ".join(e["name"] for e in entries) or "empty")
