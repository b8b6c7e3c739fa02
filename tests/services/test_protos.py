"""The committed gRPC stubs are exactly what protos/generate.py makes from the .proto files."""
from __future__ import annotations

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_protos", REPO / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_protos(tmp_path):
    fresh = _generator().generate(tmp_path)
    names = sorted(p.name for p in fresh)
    committed = sorted(p.name for p in (REPO / "specd" / "v1").glob("*_pb2*.py*"))
    assert names == committed and len(names) == 6, (names, committed)
    stale = [p.name for p in fresh if p.read_bytes() != (REPO / "specd" / "v1" / p.name).read_bytes()]
    assert not stale, f"stubs out of date: {stale}; run `python protos/generate.py` and commit"


def test_drift_is_detected(tmp_path):
    """Changing a .proto changes the generated code (so the test above can fail)."""
    gen = _generator()
    root = tmp_path / "protos"
    (root / "specd" / "v1").mkdir(parents=True)
    for proto in (REPO / "protos" / "specd" / "v1").glob("*.proto"):
        text = proto.read_text()
        if proto.name == "drafter.proto":
            text = text.replace("bool resync = 4;", "bool resync = 4;\n  uint32 extra = 99;")
        (root / "specd" / "v1" / proto.name).write_text(text)
    gen.PROTO_ROOT = root
    changed = gen.generate(tmp_path / "out")
    drafter = next(p for p in changed if p.name == "drafter_pb2.py")
    assert drafter.read_bytes() != (REPO / "specd" / "v1" / "drafter_pb2.py").read_bytes()
