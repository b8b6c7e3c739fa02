"""The import rules (docs/architecture.md, "Import rules"), read from the source of every module,
imports inside functions included (a lazy import is still an arrow):
- the shared core (specd/) never imports the services (services/ -> specd.gateway, specd.verifier,
  specd.drafter): the services host the core, not the other way round. The CLI's command table
  names service modules as strings only, to start the one a user asked for;
- the engine never imports a proposer, the CLI or a service: proposers implement the contract in
  specd/engine/spec/proposal.py and reach the engine as objects (LLMEngine's proposer or
  proposer_factory);
- the engine's rooms point one way: the loop (llm_engine) sits above the others; speculation
  (engine/spec/) imports the core step's types and never the model; the core step (the rest of
  engine/) imports the model and never speculation; the model (engine/model/) imports nothing
  else of the engine. So no circle among the rooms either;
- nothing outside the CLI's room (specd/cli/) imports it: it is the top;
- serving never imports training: specd/, kernels and services import nothing of specd_train
  (training/, its own package); the CLI names training's commands as strings;
- the rooms of specd/ (engine and its model and spec, proposers, models, rpc, cli) each have a
  docstring that says what the room is for;
- no import circle among specd's modules, kernels, services and training (typing-only imports
  under `if TYPE_CHECKING:` are not arrows at run time and are left out).
"""
from __future__ import annotations

import ast
from pathlib import Path

import specd

REPO = Path(specd.__file__).resolve().parent.parent
SERVICE_PACKAGES = ("specd.gateway", "specd.verifier", "specd.drafter")
# pyproject's package-dir: where the specd.* packages outside specd/ live
ROOTS = {"specd": REPO / "specd", "specd.kernels": REPO / "kernels", "specd.gateway": REPO / "services" / "gateway",
         "specd.verifier": REPO / "services" / "verifier", "specd.drafter": REPO / "services" / "drafter",
         "specd_train": REPO / "training" / "specd_train"}
ROOMS = ("engine", "engine/model", "engine/spec", "proposers", "models", "rpc", "cli")
# The engine's rooms: the loop wires the others together (docs/architecture.md, "Layout")
ENGINE_LOOP = "specd.engine.llm_engine"


def _imports(path: Path, module: str = ""):
    """Every module path imported in the file (relative imports resolved against `module`),
    skipping `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)  # `from pkg import module`


def _modules() -> dict[str, Path]:
    found = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("").parts
            if "v1" in rel or "__pycache__" in rel:  # generated gRPC stubs
                continue
            parts = [p for p in rel if p != "__init__"]
            name = ".".join([prefix, *parts])
            if name not in found or prefix == "specd":
                found.setdefault(name, path)
    return found


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {m for m in _imports(path, name) if m in modules and m != name} for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _offenders(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{name}: {m}" for name, path in _modules().items() if name.startswith(prefix)
            for m in _imports(path, name) if m.startswith(forbidden)]


def _engine_room(module: str) -> str | None:
    """Which of the engine's rooms a module is in: model, spec, loop or core (the rest of engine/);
    None outside the engine and for the package itself, which imports nothing."""
    if not module.startswith("specd.engine."):
        return None
    if module == ENGINE_LOOP or module.startswith(ENGINE_LOOP + "."):
        return "loop"
    room = module.split(".")[2]
    return room if room in ("model", "spec") else "core"


def _room_arrows() -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> the imports that make that arrow, between different engine rooms."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for name, path in _modules().items():
        source = _engine_room(name)
        for m in _imports(path, name) if source else ():
            target = _engine_room(m)
            if target and target != source:
                arrows.setdefault((source, target), []).append(f"{name}: {m}")
    return arrows


def test_core_never_imports_services():
    core = {n: p for n, p in _modules().items() if p.is_relative_to(REPO / "specd")}
    offenders = [f"{n}: {m}" for n, p in core.items() for m in _imports(p, n) if m.startswith(SERVICE_PACKAGES)]
    assert not offenders, offenders


def test_the_engine_imports_no_proposer_cli_or_service():
    assert not _offenders("specd.engine", ("specd.proposers", "specd.cli", *SERVICE_PACKAGES))


def test_the_model_imports_nothing_else_of_the_engine():
    arrows = _room_arrows()
    assert not [m for room in ("core", "spec", "loop") for m in arrows.get(("model", room), [])]


def test_speculation_imports_neither_the_model_nor_the_loop():
    """Drafts are tokens, and hidden states reach a drafter as a sequence's FeatureRows: the
    speculator works on the core step's types only."""
    arrows = _room_arrows()
    assert not arrows.get(("spec", "model")) and not arrows.get(("spec", "loop"))
    assert arrows.get(("spec", "core")), "the speculator no longer reads the core step's types: update the rule"


def test_the_core_step_never_imports_speculation_or_the_loop():
    """The loop alone creates the speculator; the counters a Sequence carries are core types
    (engine/spec_stats.py)."""
    arrows = _room_arrows()
    assert not arrows.get(("core", "spec")) and not arrows.get(("core", "loop"))


def test_the_engine_rooms_point_one_way():
    rooms: dict[str, set[str]] = {}
    for source, target in _room_arrows():
        rooms.setdefault(source, set()).add(target)
        rooms.setdefault(target, set())
    assert set(rooms) == {"model", "spec", "core", "loop"}
    assert not _circles(rooms)


def test_nothing_imports_the_cli():
    offenders = [f"{n}: {m}" for n, p in _modules().items() if n != "specd.cli" and not n.startswith("specd.cli.")
                 for m in _imports(p, n) if m == "specd.cli" or m.startswith("specd.cli.")]
    assert not offenders, offenders


def test_serving_never_imports_training():
    offenders = [f"{n}: {m}" for n, p in _modules().items() if not n.startswith("specd_train")
                 for m in _imports(p, n) if m.split(".")[0] == "specd_train"]
    assert not offenders, offenders


def test_each_room_says_what_it_is_for():
    for room in ROOMS:
        doc = ast.get_docstring(ast.parse((REPO / "specd" / room / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 8, f"specd/{room}/__init__.py: no docstring saying what the room is for"


def test_no_import_circles():
    assert not _circles(_graph(_modules()))


def test_the_checks_see_what_they_forbid(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from specd.drafter.server import serve\n    from ..proposers import ngram\n"
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specd.cli import main\n")
    found = list(_imports(bad, "specd.engine.bad"))
    assert "specd.drafter.server" in found and "specd.proposers.ngram" in found  # lazy and relative ones
    assert "specd.cli" not in found  # typing only
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    assert [_engine_room(m) for m in ("specd.engine.model.decoder", "specd.engine.spec.speculator",
                                      "specd.engine.sequence", "specd.engine.llm_engine", "specd.engine",
                                      "specd.proposers.base")] == ["model", "spec", "core", "loop", None, None]
