"""The shared core (specd/) never imports the services (services/ → specd.gateway,
specd.verifier, specd.drafter): proposers, engine and sampling live in the core and the
services host them. The CLI's command table names service modules as strings only, to
start the one a user asked for."""
from __future__ import annotations

import ast
from pathlib import Path

import specd

SERVICE_PACKAGES = ("specd.gateway", "specd.verifier", "specd.drafter")


def _imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_core_never_imports_services():
    core = Path(specd.__file__).parent
    offenders = [f"{p.relative_to(core)}: {name}" for p in sorted(core.rglob("*.py"))
                 for name in _imports(p) if name.startswith(SERVICE_PACKAGES)]
    assert not offenders, offenders


def test_the_check_sees_a_service_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from specd.drafter.server import serve\n")
    assert "specd.drafter.server" in list(_imports(bad))
