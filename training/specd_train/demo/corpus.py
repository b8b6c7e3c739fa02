"""The demo corpus: the Python standard library of the running interpreter.

Every machine that runs specd has it offline, so the demo pair can be retrained anywhere.
File order is sorted by relative path and a fixed list of modules is held out for
evaluation, so the train/held-out split never depends on the filesystem or on chance.
"""

from __future__ import annotations

import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Held out for evaluation, never trained on (tokenizer included). Plain, self-contained
# modules that exist in every CPython 3.8+; a package name holds out the whole package.
HELDOUT_MODULES: tuple[str, ...] = (
    "bisect", "calendar", "colorsys", "csv", "difflib", "fnmatch", "fractions",
    "graphlib", "heapq", "json", "netrc", "pprint", "sched", "shlex", "statistics",
    "string", "textwrap", "tomllib",
)

# Skipped entirely: test suites, the IDE and 2to3 (huge, unlike ordinary library code),
# third-party packages, data tables that are not code (encodings' charmaps, pydoc topics),
# and the machine-specific sysconfig data (would make the corpus differ across machines).
_SKIP_DIRS = {
    "test", "tests", "idle_test", "idlelib", "lib2to3", "site-packages", "dist-packages",
    "turtledemo", "encodings", "pydoc_data", "__pycache__", "ensurepip", "config-3",
}
_SKIP_PREFIXES = ("_sysconfigdata", "test_")


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Path, ...]    # sorted by path relative to root
    heldout: tuple[Path, ...]  # sorted by path relative to root

    @property
    def python_version(self) -> str:
        return platform.python_version()

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _skipped(rel: Path) -> bool:
    if any(p in _SKIP_DIRS or p.startswith("config-3") for p in rel.parts[:-1]):
        return True
    return rel.name.startswith(_SKIP_PREFIXES)


def _module_of(rel: Path) -> str:
    # "json/decoder.py" -> "json", "textwrap.py" -> "textwrap"
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def load_corpus(root: Path | None = None) -> Corpus:
    """Split the stdlib *.py files into train and held-out, both in sorted order."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library not found at {root}")
    files = sorted(
        (p for p in root.rglob("*.py") if p.is_file() and not _skipped(p.relative_to(root))),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    held = set(HELDOUT_MODULES)
    train = tuple(p for p in files if _module_of(p.relative_to(root)) not in held)
    heldout = tuple(p for p in files if _module_of(p.relative_to(root)) in held)
    if not train or not heldout:
        raise ValueError(f"no usable .py files under {root} (train={len(train)}, heldout={len(heldout)})")
    return Corpus(root=root, train=train, heldout=heldout)


def read_text(path: Path) -> str:
    # A few stdlib files carry latin-1 bytes; replace rather than fail, deterministically.
    return path.read_bytes().decode("utf-8", errors="replace")
